"""GGUF files (llama.cpp's format) read into a Hugging Face folder: tensors, per-family configs
and the tokenizer."""

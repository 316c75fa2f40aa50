"""Quantized linears: int8 (W8A8), GGUF blocks served packed, and the pass that marks a
model's linears for either."""

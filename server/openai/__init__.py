"""The OpenAI-compatible endpoints: protocol models, and one serving module per endpoint
(completions, chat, responses, tokenization) over a shared base."""

"""From logits to tokens: the sampler, logprobs, and constrained decoding (grammar compiler,
per-request matchers, batch masks)."""

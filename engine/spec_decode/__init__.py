"""Speculative decoding: the n-gram proposer and its config and stats; drafts are verified by
the sampler."""

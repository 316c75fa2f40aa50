"""Images in: preprocessing and placeholder expansion (processor.py), fetching media under the
operator's limits (media.py), the runner's encoder with its content-keyed cache (embedder.py,
encoder_cache.py)."""

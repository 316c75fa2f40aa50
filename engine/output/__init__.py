"""From tokens to what a client sees: incremental detokenization, stop strings, and the
per-request outputs the engine returns."""

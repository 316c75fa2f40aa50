"""The second KV tier for the prefix cache: a disk store, the runner hook, the wiring."""

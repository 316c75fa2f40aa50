"""Model folders: resolving a name, path or .gguf to a folder, and loading its weights into
the model (sharding under tensor parallelism)."""

"""The scheduling core (vLLM's v1/core): requests, the block pool, the KV cache manager and
its groups, the scheduler, and the KV view's snapshots. Nothing here imports torch."""

"""pagedserve's HTTP front end: OpenAI-compatible routes, SSE, metrics, CLI."""

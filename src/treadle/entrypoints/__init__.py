"""The entrypoints floor: the offline `LLM` and (later) the HTTP server."""

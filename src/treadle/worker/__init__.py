"""The worker floor: one device's model, KV cache, input preparation and sampling."""

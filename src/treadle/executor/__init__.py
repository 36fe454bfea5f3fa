"""The executor floor: how the engine core reaches its worker(s)."""

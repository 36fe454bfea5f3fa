"""The engine core floor: requests, the scheduler, KV blocks and the `EngineCore` step."""

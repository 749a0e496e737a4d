"""engine/kv/: see docs/architecture.md#layout."""

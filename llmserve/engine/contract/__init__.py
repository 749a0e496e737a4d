"""engine/contract/: see docs/architecture.md#layout."""

"""engine/features/: see docs/architecture.md#layout."""

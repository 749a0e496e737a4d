"""engine/parallel/: see docs/architecture.md#layout."""

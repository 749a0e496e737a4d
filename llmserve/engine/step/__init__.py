"""engine/step/: see docs/architecture.md#layout."""

"""engine/model/: see docs/architecture.md#layout."""

"""gpu/: see docs/architecture.md#layout."""

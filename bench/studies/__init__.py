"""studies/: see docs/architecture.md#layout."""

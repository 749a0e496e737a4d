"""scheduler/service/: see docs/architecture.md#layout."""

"""scheduler/disagg/: see docs/architecture.md#layout."""

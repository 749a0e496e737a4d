"""Tests of llmserve/kernel_emu/ (tests/ mirrors the code: docs/architecture.md#layout)."""

"""Tests of llmserve/engine/ (tests/ mirrors the code)."""

"""Tests of llmserve/engine/kv/ (tests/ mirrors the code)."""

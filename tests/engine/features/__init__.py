"""Tests of llmserve/engine/features/ (tests/ mirrors the code)."""

"""Tests of llmserve/common/ (tests/ mirrors the code)."""

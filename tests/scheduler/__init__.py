"""Tests of llmserve/scheduler/ (tests/ mirrors the code)."""

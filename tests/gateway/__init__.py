"""Tests of llmserve/gateway/ (tests/ mirrors the code)."""

"""Tests of llmserve/engine/model/ (tests/ mirrors the code)."""

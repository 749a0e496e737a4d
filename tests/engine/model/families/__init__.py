"""Tests of llmserve/engine/model/families/ (tests/ mirrors the code)."""

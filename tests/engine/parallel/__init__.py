"""Tests of llmserve/engine/parallel/ (tests/ mirrors the code)."""

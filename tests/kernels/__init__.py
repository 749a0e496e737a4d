"""Tests of llmserve/kernels/ (tests/ mirrors the code)."""

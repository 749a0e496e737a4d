"""Tests of the llmserve command (llmserve/cli, launcher, bench) and the bench/ scripts."""

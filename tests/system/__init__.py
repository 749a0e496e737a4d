"""Tests of the whole system: the processes started together (a stack), as a user runs them."""

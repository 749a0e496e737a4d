"""Attention and friends: CUDA C kernels compiled at run time through CuPy, each beside its
plain-torch reference in kernels/reference.py (which is also the CPU path)."""

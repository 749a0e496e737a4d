"""The CPU emulator of the CUDA kernels (tests only)."""

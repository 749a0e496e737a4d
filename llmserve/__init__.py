"""llmserve: the top layer. The `llmserve` command, the Python client, the stack launcher and the
benchmarks; it may import every service, and nothing imports it but tests and bench/."""

from llmserve.common import __version__

__all__ = ["__version__"]

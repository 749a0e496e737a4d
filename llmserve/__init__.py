"""llmserve: the CLI and the small pieces every service shares (logging, model files, gRPC
helpers). Nothing here imports torch."""

__version__ = "0.1.0"

"""The base every service imports: logging, telemetry, gRPC helpers, model files and the service
settings' command-line form. It imports none of gateway/, scheduler/, engine/ or llmserve/, and
never torch."""

__version__ = "0.1.0"

"""megastep: a decode runtime for DeepSeek-V4-family mixture-of-experts models."""

__version__ = "0.1.0"

"""ferry: hybrid CPU/GPU inference for Mixture-of-Experts GGUF models."""

__version__ = "0.1.0"

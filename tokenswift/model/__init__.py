"""Model loading and the runner that forwards an unmodified transformers model."""

from tokenswift.model.loading import load_model, tiny_model
from tokenswift.model.runner import ForwardOutput, Runner

__all__ = ["ForwardOutput", "Runner", "load_model", "tiny_model"]

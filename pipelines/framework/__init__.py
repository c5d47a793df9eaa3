"""The user base classes, for people who write their own models and pipelines."""

from .modeling import ModelConfig, ModelMixin
from .pipeline import Pipeline

__all__ = ["ModelConfig", "ModelMixin", "Pipeline"]

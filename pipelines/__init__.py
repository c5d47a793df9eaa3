"""What users touch: ModelMixin, Pipeline, the folder format, the reference models and pipelines, the CLI."""

from .config import ModelConfig
from .modeling import ModelMixin

__all__ = ["ModelConfig", "ModelMixin"]

"""What users touch: ModelMixin, Pipeline, the folder format, the reference models and pipelines, the CLI."""

from .config import ModelConfig
from .modeling import ModelMixin
from .models import AutoencoderKL, DiT, TextEncoder, UNet
from .pipeline import Pipeline
from .text_to_image import TextToImagePipeline

__all__ = ["AutoencoderKL", "DiT", "ModelConfig", "ModelMixin", "Pipeline", "TextEncoder", "TextToImagePipeline", "UNet"]

"""What users touch, by audience:

framework/      ModelMixin, Pipeline, the folder format, loading/planning/saving (for your own models and pipelines)
checkpoint/     the weights half of the folder format: safetensors shards, index, streaming loader, atomic save
text_to_image/  the reference text-to-image pipeline, its models, tokenizer, scheduler and presets
cli/            the `placement` command

Importing this package imports every library class a saved folder may name (`framework.registry`).
"""

from .framework.config import ModelConfig
from .framework.modeling import ModelMixin
from .framework.pipeline import Pipeline
from .framework.place import place
from .framework.registry import library_class, register_class
from .text_to_image.models import AutoencoderKL, DiT, TextEncoder, UNet
from .text_to_image.pipeline import TextToImagePipeline
from .text_to_image.schedulers import FlowMatchEulerScheduler
from .text_to_image.tokenizers import ByteTokenizer

__all__ = [
    "AutoencoderKL",
    "ByteTokenizer",
    "DiT",
    "FlowMatchEulerScheduler",
    "ModelConfig",
    "ModelMixin",
    "Pipeline",
    "TextEncoder",
    "TextToImagePipeline",
    "UNet",
    "library_class",
    "place",
    "register_class",
]

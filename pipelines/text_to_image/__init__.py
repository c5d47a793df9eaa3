"""The reference text-to-image pipeline, its models (text encoders, UNet, DiT, VAE), tokenizer, scheduler and
presets from "tiny-dit" to "flux-like"."""

from .pipeline import TextToImageOutput, TextToImagePipeline

__all__ = ["TextToImageOutput", "TextToImagePipeline"]

"""The reference text-to-image pipeline and everything it is built from: text encoders, denoisers (UNet, DiT),
the VAE, the tokenizer, the scheduler, and the presets from "tiny-dit" to "flux-like".

pipeline.py   TextToImagePipeline (the call), prompt -> text conditioning, example inputs for call-aware planning
presets.py    named configurations; models/: the model classes; schedulers.py, tokenizers.py
"""

from .pipeline import TextToImageOutput, TextToImagePipeline

__all__ = ["TextToImageOutput", "TextToImagePipeline"]

"""What users touch, by audience:

framework/      ModelMixin, Pipeline, the folder format, loading/planning/saving (for your own models and pipelines)
checkpoint/     the weights half of the folder format: safetensors shards, index, streaming loader, atomic save
text_to_image/  the reference text-to-image pipeline, its models, tokenizer, scheduler and presets
cli/            the `placement` command

Names are imported on first use (PEP 562), so that `placement --help` (the console script lives in
`pipelines.cli`) does not import torch. `import_library_classes()` imports every library class a saved folder
may name (`framework.registry` calls it).
"""

import importlib

_EXPORTS = {
    "ModelConfig": ".framework.config",
    "ModelMixin": ".framework.modeling",
    "Pipeline": ".framework.pipeline",
    "library_class": ".framework.registry",
    "register_class": ".framework.registry",
    "place": ".framework.place",
    "AutoencoderKL": ".text_to_image.models",
    "DiT": ".text_to_image.models",
    "TextEncoder": ".text_to_image.models",
    "UNet": ".text_to_image.models",
    "TextToImagePipeline": ".text_to_image.pipeline",
    "FlowMatchEulerScheduler": ".text_to_image.schedulers",
    "ByteTokenizer": ".text_to_image.tokenizers",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


def import_library_classes() -> None:
    """Import every module that defines a library class, so that each is registered by name."""
    for module in sorted(set(_EXPORTS.values())):
        importlib.import_module(module, __name__)


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

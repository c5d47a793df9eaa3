"""What users touch: cli/, distributed/, presets/ (the folders of the presets built from diffusers classes),
text_to_image/, framework/ (the user base classes), loading/, hf/ (the diffusers/transformers bridge), folder/,
checkpoint/, errors.py; each subpackage imports only those below it.

Names are imported on first use (PEP 562), so that `placement --help` does not import torch. The class registry
is told here which library classes a saved folder may name, so that it never names this package itself.
"""

import functools
import importlib

from .folder import class_registry as _class_registry

# The classes a saved folder may name as ["pipelines", ClassName] (each is a `@library_class`), by module.
_LIBRARY_CLASSES = {
    "Pipeline": ".framework.pipeline",
    "AutoencoderKL": ".text_to_image.models",
    "DiT": ".text_to_image.models",
    "TextEncoder": ".text_to_image.models",
    "UNet": ".text_to_image.models",
    "TextToImagePipeline": ".text_to_image.pipeline",
    "FlowMatchEulerScheduler": ".text_to_image.schedulers",
    "ByteTokenizer": ".text_to_image.tokenizers",
}
_EXPORTS = {
    **_LIBRARY_CLASSES,
    "ModelConfig": ".framework.modeling",
    "ModelMixin": ".framework.modeling",
    "library_class": ".folder.class_registry",
    "register_class": ".folder.class_registry",
    "place": ".loading.pipeline_loader",
    "load_model": ".loading.single_model",
    "plan_model": ".loading.single_model",
    "preset_folder": ".presets.catalog",
}

# Every name in the `__all__` of `errors.py`: a type added there is exported here without a second list.
_ERROR_MODULE = ".errors"


@functools.cache
def _errors() -> dict[str, str]:
    """{error name: its module}. Importing the errors module imports torch (through `placement`), so this runs
    when a name is first looked up, never for `placement --help`."""
    return {name: _ERROR_MODULE for name in importlib.import_module(_ERROR_MODULE, __name__).__all__}


def __getattr__(name: str):
    if name == "__all__":
        return sorted([*_EXPORTS, *_errors()])
    module = _EXPORTS.get(name) or _errors().get(name)
    if module is None:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_errors()])


def import_library_classes() -> None:
    """Import every module that defines a library class, so that each is registered by name."""
    for module in sorted(set(_LIBRARY_CLASSES.values())):
        importlib.import_module(module, __name__)


_class_registry.declare_library_classes(
    {name: functools.partial(importlib.import_module, module, __name__) for name, module in _LIBRARY_CLASSES.items()}
)


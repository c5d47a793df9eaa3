"""What users touch, cut along the data flow (each subpackage imports only those below it; tests/test_layering.py):

cli/            the `placement` command
distributed/    replicas under torchrun: load_replica, the `placement run` job
text_to_image/  the reference text-to-image pipeline, its models, tokenizer, scheduler and presets
framework/      the user base classes: ModelConfig, ModelMixin, Pipeline (and their memory methods)
loading/        the one loader of models and pipelines: request, meta build, plan, place, undo
hf/             the diffusers/transformers bridge, and the calls of diffusers' pipeline families
folder/         what a folder is: model_index.json, component sources, the Hub, snapshots, class registry, saving
checkpoint/     the file format only: safetensors shards and index, config files, atomic save, streaming
errors.py       the middle of the error tree (FolderError, LoadError); every error is exported here by name

Names are imported on first use (PEP 562), so that `placement --help` (the console script lives in
`pipelines.cli`) does not import torch. The class registry (`folder.class_registry`) is told here which library
classes a saved folder may name and how to import each, so that it never names this package itself.
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
    "ModelConfig": ".framework.config",
    "ModelMixin": ".framework.modeling",
    "library_class": ".folder.class_registry",
    "register_class": ".folder.class_registry",
    "place": ".loading.place",
    "load_model": ".loading.single_model",
    "plan_model": ".loading.single_model",
}

# Every error of this package, by the module that defines it: `pipelines.WeightsNotFoundError`, ...
_ERRORS = {
    ".errors": ("CallError", "DeviceMappedError", "FolderError", "LoadError"),
    ".checkpoint.checkpoint_errors": (
        "CheckpointDtypeError", "CheckpointError", "CheckpointKeysError", "CheckpointReadError",
        "CheckpointSaveError", "CheckpointShapeError", "CorruptCheckpointError", "InvalidConfigError",
        "UnsafeCheckpointPathError", "VariantNotFoundError", "WeightsNotFoundError",
    ),
    ".folder.component_classes": ("ComponentBuildError", "MissingConfigError"),
    ".folder.components": ("PipelineComponentError",),
    ".folder.model_index": ("ModelIndexError", "UntrustedClassError"),
    ".folder.pipeline_saving": ("PipelineSaveError",),
    ".folder.snapshot": ("FolderChangedError",),
    ".hf.adapters": ("AdapterPlacementError",),
    ".hf.calls": ("CallSpecError", "UnknownPipelineCallError"),
    ".hf.diffusers_pipeline": ("DiffusersPipelineError", "MissingComponentsError"),
    ".hf.hf_spellings": ("LoadArgumentError",),
    ".loading.placing": ("AcceleratorsMissingError", "PipelineLoadError"),
    ".loading.formats": ("FormatOptionError", "FormatPlacementError"),
    ".loading.model_loader": ("ForeignModelFolderError",),
    ".loading.owner_reading": ("OwnerPlacementError",),
    ".hf.owner_loading": ("OwnerLoadError",),
    ".hf.quantizers": ("QuantizationConfigError",),
    ".hf.single_file": ("SingleFileError",),
    ".folder.sources": ("ModelFolderError",),
    ".loading.saved_plans": ("SavedPlanError",),
    ".framework.memory": ("VaeFeatureError",),
    ".text_to_image.conditioning": ("TextConditioningError",),
    ".text_to_image.inputs": ("ActivationInputsError",),
    ".text_to_image.models.inputs": ("ModelInputError",),
    ".text_to_image.pipeline": ("PipelineCallError",),
    ".text_to_image.presets": ("UnknownPresetError",),
    ".text_to_image.schedulers": ("SchedulerError",),
    ".text_to_image.tokenizers": ("TokenizerError",),
    ".distributed.images": ("ImageRunError",),
    ".distributed.replica": ("ReplicaLoadError",),
}
_EXPORTS.update({name: module for module, names in _ERRORS.items() for name in names})


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
    for module in sorted(set(_LIBRARY_CLASSES.values())):
        importlib.import_module(module, __name__)


_class_registry.declare_library_classes(
    {name: functools.partial(importlib.import_module, module, __name__) for name, module in _LIBRARY_CLASSES.items()}
)

__all__ = sorted(_EXPORTS)

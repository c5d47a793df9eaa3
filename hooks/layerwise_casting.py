"""Layerwise casting: weights stored in a small dtype (fp8 by default) and upcast one layer at a time.

    apply_layerwise_casting(denoiser, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)

Each Linear / Conv layer's hook puts a `compute_dtype` copy in the module for its forward only, and puts the
stored tensor back after it. Norms and embeddings are skipped by default (small, precision sensitive). Apply it
before group offloading or per-call residency (the groups then hold the small dtype); removing it leaves the
rounding.

Why not accelerate's hooks (`accelerate.hooks.LayerwiseCastingHook`, attached by
`accelerate.big_modeling.attach_layerwise_casting_hooks`): they compose with group offloading's stores during a
call, but their `post_forward` casts the layer down again (`module.to(storage_dtype)`) instead of putting the
stored tensor back, so a call under `torch.inference_mode()` (every pipeline's `__call__`) leaves inference tensors
as the stored weights, and group offloading applied after that call (`pipe.enable_group_offload`) fails making
them parameters ("Setting requires_grad=True on inference tensor"); it also costs a second cast per layer per
call. Their attach function also detaches the hooks already on a layer and initialises them again (`append=True`;
`hook_utils.add_hook_last` keeps them). tests/hooks/test_layerwise_casting.py shows the inference-mode case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.hooks import ModelHook
from torch import nn

from .errors import OffloadConfigError
from .hook_utils import add_hook_last, remove_hooks_of_type
from .techniques import Handle, Technique, TechniqueConfig, TechniqueSpec, check_compatible, register
from .tensor_slots import ModelTensor, collect_entries, direct_tensor_ids

__all__ = ["SPEC", "DEFAULT_SKIP_MODULES_CLASSES", "DEFAULT_SKIP_MODULES_PATTERN", "LayerwiseCastingConfig",
           "LayerwiseCastingHook", "apply_layerwise_casting", "layerwise_casting_fields", "remove_layerwise_casting"]

CASTABLE_LAYERS = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.Embedding,
)
DEFAULT_SKIP_MODULES_CLASSES = (
    nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)
# Searched (re.search) in qualified module names: norms, embeddings, and patch/position embeddings.
DEFAULT_SKIP_MODULES_PATTERN = ("norm", "emb")


@dataclass(frozen=True, kw_only=True)
class LayerwiseCastingConfig(TechniqueConfig, technique="layerwise casting", name="LAYERWISE_CASTING"):
    """Dtypes may be strings ("float8_e4m3fn"); `skip_modules_pattern`: regexes searched in qualified names
    (None: the default; `()`: by class only). Normalised and checked on construction."""

    storage_dtype: torch.dtype | str = torch.float8_e4m3fn
    compute_dtype: torch.dtype | str = torch.bfloat16
    skip_modules_pattern: tuple[str, ...] | list[str] | str | None = None
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # normalising a frozen dataclass's own fields
        set_field(self, "storage_dtype", _dtype(self.storage_dtype, "storage_dtype"))
        set_field(self, "compute_dtype", _dtype(self.compute_dtype, "compute_dtype"))
        set_field(self, "skip_modules_pattern", _patterns(self.skip_modules_pattern))
        classes = self.skip_modules_classes
        set_field(self, "skip_modules_classes", DEFAULT_SKIP_MODULES_CLASSES if classes is None else tuple(classes))

    def skips(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, self.skip_modules_classes) or any(
            re.search(pattern, name) for pattern in self.skip_modules_pattern
        )


class LayerwiseCastingHook(ModelHook):
    technique = Technique.LAYERWISE_CASTING

    def __init__(self, *, entries: tuple[ModelTensor, ...], config: LayerwiseCastingConfig) -> None:
        self.entries = entries
        self.config = config
        self._swapped: list[tuple[ModelTensor, torch.Tensor, torch.Tensor]] = []

    def __repr__(self) -> str:
        return f"LayerwiseCastingHook({self.config.storage_dtype} -> {self.config.compute_dtype})"

    def pre_forward(self, module, *args, **kwargs):
        self._swapped = []
        for entry in self.entries:
            stored = entry.get()
            if stored.dtype != self.config.storage_dtype:
                continue  # already upcast by an enclosing call of the same module
            entry.set(stored.to(self.config.compute_dtype))
            self._swapped.append((entry, stored, entry.get()))
        return args, kwargs

    def post_forward(self, module, output):
        for entry, stored, upcast in self._swapped:
            # Another technique (group offloading) may already have swapped the tensor out; leave its choice.
            if entry.get() is upcast:
                entry.set(stored)
        self._swapped = []
        return output

    def detach_hook(self, module):
        for entry in self.entries:
            if entry.get().dtype == self.config.storage_dtype:
                entry.set(entry.get().to(self.config.compute_dtype))
        return module


LAYERWISE_CASTING_FIELDS = ("storage_dtype", "compute_dtype", "skip_modules_pattern", "skip_modules_classes")


def layerwise_casting_fields(storage_dtype: Any, compute_dtype: Any, skip_modules_pattern: Any,
                             skip_modules_classes: Any, non_blocking: bool = False) -> dict[str, Any]:
    """The `LayerwiseCastingConfig` fields for diffusers' spelling of `apply_layerwise_casting` (None: default)."""
    del non_blocking  # accepted for diffusers' signature: casts run on the weights' own device
    values = dict(zip(LAYERWISE_CASTING_FIELDS, (storage_dtype, compute_dtype, skip_modules_pattern,
                                                 skip_modules_classes)))
    return {key: value for key, value in values.items() if value is not None}


def apply_layerwise_casting(
    module: nn.Module,
    storage_dtype: LayerwiseCastingConfig | torch.dtype | str | None = None,
    compute_dtype: torch.dtype | str | None = None,
    skip_modules_pattern: tuple[str, ...] | list[str] | str | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> Handle:
    """Store `module`'s Linear/Conv weights in `storage_dtype`, compute in `compute_dtype` (again: replaces it).
    Takes a `LayerwiseCastingConfig` or diffusers' spelling (`layerwise_casting_fields`)."""
    if isinstance(storage_dtype, LayerwiseCastingConfig):
        config = storage_dtype
    else:
        config = LayerwiseCastingConfig(**layerwise_casting_fields(
            storage_dtype, compute_dtype, skip_modules_pattern, skip_modules_classes, non_blocking))
    check_compatible(module, SPEC)
    remove_layerwise_casting(module)
    targets = [(name, layer) for name, layer in module.named_modules()
               if isinstance(layer, CASTABLE_LAYERS) and not config.skips(name, layer)]
    _check_dtypes(module, config, targets)
    entries = collect_entries(module)
    for _, layer in targets:
        layer_entries = tuple(entries[tid] for tid in direct_tensor_ids(layer)
                              if entries[tid].get().is_floating_point())
        for entry in layer_entries:
            if entry.get().dtype != config.storage_dtype:  # a tied tensor is cast once
                entry.set(entry.get().detach().to(config.storage_dtype))
        add_hook_last(layer, LayerwiseCastingHook(entries=layer_entries, config=config))
    return Handle(technique=Technique.LAYERWISE_CASTING, module=module, config=config,
                  remover=remove_layerwise_casting)


def remove_layerwise_casting(module: nn.Module) -> None:
    """Remove the casting hooks of `module`'s tree; weights go back to the compute dtype."""
    remove_hooks_of_type(module, LayerwiseCastingHook)


def _dtype(value, field: str) -> torch.dtype:
    if isinstance(value, str):
        resolved = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise OffloadConfigError(
                f"{field}={value!r}: this torch ({torch.__version__}) has no such dtype. "
                "Use e.g. torch.float8_e4m3fn, torch.bfloat16 or torch.float16."
            )
        value = resolved
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise OffloadConfigError(f"{field}={value!r} must be a floating torch.dtype (e.g. torch.float8_e4m3fn).")
    return value


def _patterns(value) -> tuple[str, ...]:
    if value is None:
        return DEFAULT_SKIP_MODULES_PATTERN
    patterns = (value,) if isinstance(value, str) else tuple(value)
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as error:
            raise OffloadConfigError(f"skip_modules_pattern {pattern!r} is not a valid regex: {error}.") from error
    return patterns


def _check_dtypes(module: nn.Module, config: LayerwiseCastingConfig, targets) -> None:
    """The storage dtype must round-trip on the weights' device; the rest must already compute in compute_dtype."""
    devices = {p.device for _, layer in targets for p in layer.parameters(recurse=False)} or {torch.device("cpu")}
    for device in devices:
        try:
            torch.ones(2, device=device).to(config.storage_dtype).to(config.compute_dtype)
        except (RuntimeError, TypeError) as error:
            raise OffloadConfigError(
                f"This torch ({torch.__version__}) cannot hold weights as {config.storage_dtype} on {device} "
                f"({error}). Choose another storage_dtype, e.g. torch.float16 or torch.bfloat16."
            ) from error
    target_ids = {id(layer) for _, layer in targets}
    wrong = [
        f"{name} ({tensor.dtype})"
        for name, tensor in module.named_parameters()
        if tensor.is_floating_point() and tensor.dtype not in (config.compute_dtype, config.storage_dtype)
        and id(module.get_submodule(name.rpartition(".")[0])) not in target_ids
    ]
    if wrong:
        raise OffloadConfigError(
            f"Layerwise casting computes in {config.compute_dtype}, but layers it does not cast are in other dtypes: "
            f"{wrong[:3]}{' ...' if len(wrong) > 3 else ''}. Load the model with torch_dtype={config.compute_dtype} "
            f"or call module.to({config.compute_dtype}) first."
        )


SPEC = register(TechniqueSpec(
    technique=Technique.LAYERWISE_CASTING,
    config_class=LayerwiseCastingConfig,
    apply=apply_layerwise_casting,
    remove=remove_layerwise_casting,
    refuses={
        Technique.SEQUENTIAL_OFFLOAD: (
            "its weights come back from a full-precision state dict on every call, so casting would save nothing. "
            "Casting combines with group offloading (applied after casting) and model offload"
        ),
        Technique.GROUP_OFFLOAD: (
            "apply layerwise casting first, then group offloading (remove_group_offloading(module), "
            "apply_layerwise_casting(...), apply_group_offloading(...))"
        ),
    },
    offloads_weights=False,
))

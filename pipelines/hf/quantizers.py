"""Quantized components through their owners' quantizers: which config applies to a component, and the meta
module prepared as the owner's `from_pretrained` prepares it, each weight in its quantized form while still on
meta, so the planner sizes what will be loaded."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..checkpoint.files import read_config_dict
from ..errors import LoadError
from ..folder.families import ModelFamily


class QuantizationMethod(str, Enum):
    """The formats this library plans and places, by the owner libraries' `quant_method` names."""

    BITSANDBYTES_4BIT = "bitsandbytes_4bit"
    BITSANDBYTES_8BIT = "bitsandbytes_8bit"
    TORCHAO = "torchao"
    QUANTO = "quanto"
    GGUF = "gguf"
    OTHER = "other"  # a method the owner knows and we size as its replaced layers declare
    LAYERWISE_CASTING = "layerwise_casting"  # no quantizer: fp8 storage set by layerwise_casting= (plain tensors)


@dataclass(frozen=True, kw_only=True)
class ComponentQuantization:
    """How one component is quantized: the owner's config object, whether its folder holds it quantized, the format."""

    config: Any
    pre_quantized: bool
    method: QuantizationMethod

    @property
    def bitsandbytes(self) -> bool:
        return self.method in (QuantizationMethod.BITSANDBYTES_4BIT, QuantizationMethod.BITSANDBYTES_8BIT)


def _as_dict(config: Any) -> Mapping:
    return config if isinstance(config, Mapping) else config.to_dict()


def method_of(config: Any) -> QuantizationMethod:
    """The format a diffusers or transformers quantization config (object or dict) asks for."""
    as_dict = _as_dict(config)
    method = str(getattr(as_dict.get("quant_method"), "value", as_dict.get("quant_method")))
    if method == "bitsandbytes":
        method = "bitsandbytes_8bit" if as_dict.get("load_in_8bit") else "bitsandbytes_4bit"
    try:
        return QuantizationMethod(method)
    except ValueError:
        return QuantizationMethod.OTHER


def folder_quantization(folder: Path, *, name: str = "", family: ModelFamily | None = None) -> dict | None:
    """The `quantization_config` a pre-quantized save wrote into its config.json (None when none), checked by
    the owner's config class when `family` is given."""
    if not (folder / "config.json").is_file():
        return None  # a folder without its config fails where it is built, with its own message
    found = read_config_dict(folder).get("quantization_config")
    if found is None:
        return None
    if family is not None and family.quantizable:
        owner_config(found, name=name, family=family, source=f"{str(folder / 'config.json')!r} quantization_config")
    return dict(found) if isinstance(found, Mapping) else None


def requested_quantization(quantization_config: Any, name: str, family: ModelFamily) -> Any | None:
    """The config `quantization_config=` gives component `name`, or None: from a diffusers
    `PipelineQuantizationConfig` (as diffusers resolves it), a mapping `{component: config}`, or one config object."""
    if quantization_config is None:
        return None
    if _is_pipeline_config(quantization_config):
        # one of our own models gets what diffusers would give it, so that quantizing it is refused, not ignored
        return quantization_config._resolve_quant_config(
            is_diffusers=family.resolves_pipeline_configs_as_diffusers(), module_name=name)
    if isinstance(quantization_config, Mapping) and not is_config_dict(quantization_config):
        return quantization_config.get(name)
    return quantization_config


def is_config_dict(value: Any) -> bool:
    """A quantization config written as a dict (`{"quant_method": ...}`, bitsandbytes' `load_in_4bit`), not a
    mapping {component: config}."""
    return isinstance(value, Mapping) and bool({"quant_method", "load_in_4bit", "load_in_8bit"} & set(value))


def requested_names(quantization_config: Any) -> list[str]:
    """The components a `PipelineQuantizationConfig` or a mapping {component: config} quantizes (none for None)."""
    if quantization_config is None:
        return []
    if _is_pipeline_config(quantization_config):
        return list(quantization_config.quant_mapping or {}) + list(quantization_config.components_to_quantize or [])
    if isinstance(quantization_config, Mapping) and not is_config_dict(quantization_config):
        return list(quantization_config)
    raise LoadError(
        f"quantization_config={type(quantization_config).__name__}(...) for a pipeline must say which "
        "components it quantizes: give a diffusers PipelineQuantizationConfig (quant_backend=..., "
        "components_to_quantize=[...]) or a mapping {component: config}."
    )


def _is_pipeline_config(config: Any) -> bool:
    return callable(getattr(config, "_resolve_quant_config", None))


def component_quantization(quantization_config: Any, name: str, family: ModelFamily,
                           folder: Path | None) -> ComponentQuantization | None:
    """The quantization of one component: the folder's (pre-quantized) merged with a requested one as the owner
    merges them, or the requested one alone; None for a dense component."""
    requested = requested_quantization(quantization_config, name, family)
    saved = folder_quantization(folder, name=name, family=family) if folder is not None else None
    if saved is None and requested is None:
        return None
    if not family.quantizable:
        raise LoadError(
            f"Component {name!r} is a pipelines.ModelMixin; quantization is applied by diffusers' and transformers' "
            "quantizers to their own models only. Quantize it in memory and pass it in, or leave it dense."
        )
    if requested is not None:
        requested = owner_config(requested, name=name, family=family, source="quantization_config=")
    if saved is not None:
        config = family.auto_quantizer().merge_quantization_configs(saved, requested)
    else:
        config = requested
    _check_library(config, name, family)
    return ComponentQuantization(config=config, pre_quantized=saved is not None, method=method_of(config))


# What an owner's config class raises for a config it cannot take (torchao's asserts its quant_type's shape).
_REFUSED_BY_OWNER = (ValueError, KeyError, TypeError, AssertionError, AttributeError, ImportError)


def owner_config(value: Any, *, name: str, family: ModelFamily, source: str) -> Any:
    """`value` as its owner's config object, checked by the owner's config class (`from_dict`); anything the owner
    would not apply as asked (an unknown method, a library not installed, a field missing, contradictory fields) is
    a one-line `LoadError` naming the component, the field and the accepted values."""
    if not isinstance(value, Mapping):
        if callable(getattr(value, "to_dict", None)):
            return value
        raise LoadError(
            f"Component {name!r}: {source} is {value!r}, not a quantization config; give an object with "
            f"'quant_method' one of {_methods(family)}, as {family.name} writes it (its config's to_dict())."
        )
    method = _method_named(value)
    if method not in _methods(family):
        raise LoadError(
            f"Component {name!r}: {source} has quant_method={method!r}, which {family.name} does not know; the "
            f"accepted values are {_methods(family)}."
        )
    try:
        config = family.config_from_dict(value)
    except _REFUSED_BY_OWNER as error:
        raise LoadError(_refusal(name, source, method, error, family)) from None
    return config


def _method_named(value: Mapping) -> str:
    if value.get("load_in_4bit") or value.get("load_in_8bit"):  # as the owners read bitsandbytes' flags
        return "bitsandbytes_4bit" if value.get("load_in_4bit") else "bitsandbytes_8bit"
    return str(getattr(value.get("quant_method"), "value", value.get("quant_method")))


def _refusal(name: str, source: str, method: str, error: Exception, family: ModelFamily) -> str:
    start = f"Component {name!r}: {source} (quant_method={method!r})"
    if isinstance(error, KeyError):
        example = (" as TorchAoConfig(Int8WeightOnlyConfig()).to_dict() writes it: {'default': {'_type': "
                   "'Int8WeightOnlyConfig', '_data': {}}}" if method == "torchao" else "")
        return f"{start} has no {error.args[0]!r} field, which {family.name}' config class needs; give it{example}."
    if isinstance(error, ImportError):
        return f"{start} needs a library that is not installed ({error}); install it, or choose another method."
    detail = str(error).strip().rstrip(".") or type(error).__name__
    return f"{start} is refused by {family.name}' own config class: {detail}. Fix that field."


def _methods(family: ModelFamily) -> list[str]:
    return sorted(str(method) for method in family.quantizer_mapping())


def _check_library(config: Any, name: str, family: ModelFamily) -> None:
    library = type(config).__module__.split(".")[0]
    if isinstance(config, Mapping) or library == family.name:
        return
    raise LoadError(
        f"Component {name!r} is a {family.name} model but its quantization config is {library}' "
        f"{type(config).__name__}; use {family.name}' own (e.g. {family.name}.BitsAndBytesConfig), as "
        "diffusers' PipelineQuantizationConfig(quant_mapping=...) requires."
    )


def owner_quantizer(quantization: ComponentQuantization, family: ModelFamily, *, name: str = ""):
    """The owner library's quantizer for `quantization`, its environment unchecked (planning for a GPU machine works
    on a laptop; the owner's own load checks it)."""
    try:
        return family.auto_quantizer().from_config(quantization.config, pre_quantized=quantization.pre_quantized)
    except ImportError as error:
        raise LoadError(
            f"Component {name!r}: quant_method={_method_named(_as_dict(quantization.config))!r} needs a library "
            f"that is not installed ({error}); install it, or choose another method."
        ) from None


def quantized_parameter_names(module: nn.Module, quantizer, family: ModelFamily) -> list[str]:
    """The parameters the owner's quantizer quantizes when loading (its own test, asked per parameter)."""
    return [name for name, param in module.named_parameters() if family.quantizes(quantizer, module, name, param)]


def materialize_on_meta(module: nn.Module, quantization: ComponentQuantization, names: list[str]) -> None:
    """Put every weight in `names` in its quantized form, on meta: torchao's `quantize_` and quanto's `freeze`
    run on meta tensors; bitsandbytes' replaced layers are already what `placement.sizing` counts."""
    owners = {name.rpartition(".")[0] for name in names}
    if quantization.method is QuantizationMethod.TORCHAO:
        from torchao.quantization import quantize_

        config = quantization.config.get_apply_tensor_subclass()
        if type(config).__name__ == "FqnToConfig":
            quantize_(module, config)
        else:
            _quantize_once_per_shape(module, config, owners, quantize_)
    elif quantization.method is QuantizationMethod.QUANTO:
        for path in sorted(owners):
            layer = module.get_submodule(path)
            if callable(getattr(layer, "freeze", None)):
                layer.freeze()


def _quantize_once_per_shape(module: nn.Module, config: Any, owners: set[str], quantize_: Any) -> None:
    """torchao's `quantize_` run once per distinct layer (class, weight shape and dtype, bias) and copied to the
    others: on meta the result depends on nothing else, and quantizing each of ~700 Linears takes seconds."""
    signatures = {path: _signature(module.get_submodule(path)) for path in sorted(owners)}
    first: dict[tuple, str] = {}
    for path, signature in signatures.items():
        first.setdefault(signature, path)
    representatives = set(first.values())
    quantize_(module, config, filter_fn=lambda _, fqn: fqn in representatives)
    quantized = {signature: module.get_submodule(path).weight for signature, path in first.items()}
    for path, signature in signatures.items():
        if path not in representatives:
            module.get_submodule(path).weight = copy.deepcopy(quantized[signature])


def _signature(layer: nn.Module) -> tuple:
    weight = getattr(layer, "weight", None)
    shape = None if weight is None else (tuple(weight.shape), weight.dtype, weight.device.type)
    return type(layer), shape, getattr(layer, "bias", None) is None


def format_label(quantization: ComponentQuantization) -> str:
    """The format in a plan's words (as `placement.sizing` names loaded tensors): "nf4 (bitsandbytes)",
    "Int8WeightOnlyConfig (torchao)", "int8 (quanto)", ..."""
    config = quantization.config
    as_dict = config if isinstance(config, Mapping) else config.to_dict()
    if quantization.method is QuantizationMethod.BITSANDBYTES_4BIT:
        return f"{as_dict.get('bnb_4bit_quant_type', 'fp4')} (bitsandbytes)"
    if quantization.method is QuantizationMethod.BITSANDBYTES_8BIT:
        return "int8 (bitsandbytes)"
    if quantization.method is QuantizationMethod.TORCHAO:
        kind = getattr(config, "quant_type", None)
        return f"{type(kind).__name__ if kind is not None and not isinstance(kind, str) else kind} (torchao)"
    if quantization.method is QuantizationMethod.QUANTO:
        return f"{as_dict.get('weights_dtype') or as_dict.get('weights')} (quanto)"
    return f"{quantization.method.value}"


__all__ = ["ComponentQuantization", "QuantizationMethod", "component_quantization", "folder_quantization",
           "format_label", "materialize_on_meta", "is_config_dict", "method_of", "owner_config", "owner_quantizer",
           "quantized_parameter_names", "requested_names", "requested_quantization"]

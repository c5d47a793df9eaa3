"""A component class's family: the library that owns its format (diffusers, transformers), resolved once per
component by `family_of` and then asked, never switched on. Each family says how its models are constructed on
meta from a config.json, re-tied after `init_empty_weights()`, quantized by its owner's quantizer, read by its
owner's `from_pretrained`, and which weight file they save. The two libraries spell the same steps differently
(transformers' `dtype=` and `update_dtype`, diffusers' `torch_dtype=` and `update_torch_dtype`, ...): each
difference is one method here, so the loader reads the same for both."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch
from pydantic import BaseModel
from torch import nn

from ..checkpoint import DIFFUSERS_WEIGHTS_NAME, TRANSFORMERS_WEIGHTS_NAME, WeightsNotFoundError, tie_weights
from ..checkpoint.files import CONFIG_NAME, read_config
from ..errors import FolderError


class OwnModel(nn.Module):
    """The contract of a model saved in this library's format, as the folder format and the loader read it."""

    config_class: ClassVar[type[BaseModel]]
    weights_name: ClassVar[str] = DIFFUSERS_WEIGHTS_NAME
    _no_split_modules: ClassVar[list[str] | None] = None
    _keep_in_fp32_modules: ClassVar[list[str] | None] = None
    _tied_weights_keys: ClassVar[dict[str, str] | None] = None


class ModelFamily:
    """The diffusers way, which transformers' family overrides where it differs."""

    name: ClassVar[str] = "diffusers"
    is_module: ClassVar[bool] = True
    quantizable: ClassVar[bool] = True  # its owner's quantizers apply (`quantization_config=`)
    reads_single_files: ClassVar[bool] = True  # `from_single_file` (original layouts, GGUF)
    renames_checkpoint_keys: ClassVar[bool] = False  # transformers' conversion mapping, applied on load
    checks_every_checkpoint: ClassVar[bool] = False  # keys checked even when the weights are not about to be read
    dtype_keyword: ClassVar[str] = "torch_dtype"

    def __repr__(self) -> str:
        return f"<{self.name} family>"

    def weights_name(self, cls: type) -> str:
        return DIFFUSERS_WEIGHTS_NAME

    def construct(self, cls: type, folder: Path) -> nn.Module:
        """`cls` built from `folder/config.json` (under the caller's `init_empty_weights()`)."""
        _require_config(folder)
        return cls.from_config(cls.load_config(folder))

    def retie(self, module: nn.Module) -> None:
        """Redo the constructor's weight ties, which `init_empty_weights()` breaks."""
        if callable(getattr(module, "tie_weights", None)):
            module.tie_weights()

    def declared_ties(self, module: nn.Module) -> Mapping[str, str]:
        """{tied name: source} the class declares beyond the parameters it shares (none for the owners' models)."""
        return {}

    def from_pretrained(self, cls: type, source: Path | str, *, dtype: torch.dtype | None, **arguments: Any) -> Any:
        """The owner's own load, its dtype keyword spelled as the owner spells it."""
        return cls.from_pretrained(source, **{self.dtype_keyword: dtype}, **arguments)

    def library(self):
        """The owner library's module (its `BitsAndBytesConfig`, `TorchAoConfig`, ...)."""
        return importlib.import_module(self.name)

    def resolves_pipeline_configs_as_diffusers(self) -> bool:
        """How diffusers' `PipelineQuantizationConfig` resolves a component of this family."""
        return True

    def quantizer_mapping(self) -> Mapping[str, type]:
        from diffusers.quantizers.auto import AUTO_QUANTIZER_MAPPING
        return AUTO_QUANTIZER_MAPPING

    def config_from_dict(self, value: Mapping) -> Any:
        from diffusers.quantizers.auto import DiffusersAutoQuantizer
        return DiffusersAutoQuantizer.from_dict(dict(value))  # diffusers' config-from-dict lives on its quantizer

    def auto_quantizer(self):
        from diffusers.quantizers.auto import DiffusersAutoQuantizer
        return DiffusersAutoQuantizer

    def compute_dtype(self, quantizer: Any, dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the quantizer loads the non-quantized tensors in (bitsandbytes' default when none is given)."""
        return quantizer.update_torch_dtype(dtype)

    def prepare_on_meta(self, module: nn.Module, quantizer: Any, *, dtype: torch.dtype | None, keep_in_fp32: list[str],
                        checkpoint_files: list[str] | None) -> None:
        """What the owner's `from_pretrained` does to the meta model before reading weights."""
        quantizer.preprocess_model(model=module, device_map=None, keep_in_fp32_modules=keep_in_fp32)

    def quantizes(self, quantizer: Any, module: nn.Module, name: str, param: torch.Tensor) -> bool:
        """Whether the owner's quantizer quantizes parameter `name` when loading (its own test)."""
        return bool(quantizer.check_if_quantized_param(module, param, name, {}))

    def keeps_fp32_under(self, quantizer: Any) -> bool:
        """diffusers keeps `_keep_in_fp32_modules` under a quantizer only when the quantizer says so."""
        return bool(getattr(quantizer, "use_keep_in_fp32_modules", False))

    def takes_multi_device_maps(self, quanto: bool) -> bool:
        """diffusers' quanto quantizer refuses a device map of several entries."""
        return not quanto


class TransformersFamily(ModelFamily):
    name = "transformers"
    reads_single_files = False
    renames_checkpoint_keys = True
    dtype_keyword = "dtype"

    def weights_name(self, cls: type) -> str:
        return TRANSFORMERS_WEIGHTS_NAME

    def construct(self, cls: type, folder: Path) -> nn.Module:
        _require_config(folder)
        return cls._from_config(cls.config_class.from_pretrained(folder))

    def resolves_pipeline_configs_as_diffusers(self) -> bool:
        return False

    def quantizer_mapping(self) -> Mapping[str, type]:
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
        return AUTO_QUANTIZER_MAPPING

    def config_from_dict(self, value: Mapping) -> Any:
        from transformers.quantizers.auto import AutoQuantizationConfig
        return AutoQuantizationConfig.from_dict(dict(value))

    def auto_quantizer(self):
        from transformers.quantizers.auto import AutoHfQuantizer
        return AutoHfQuantizer

    def compute_dtype(self, quantizer: Any, dtype: torch.dtype | None) -> torch.dtype | None:
        return quantizer.update_dtype(dtype)

    def prepare_on_meta(self, module: nn.Module, quantizer: Any, *, dtype: torch.dtype | None, keep_in_fp32: list[str],
                        checkpoint_files: list[str] | None) -> None:
        quantizer.preprocess_model(model=module, dtype=dtype, device_map=None, checkpoint_files=checkpoint_files)

    def quantizes(self, quantizer: Any, module: nn.Module, name: str, param: torch.Tensor) -> bool:
        return bool(quantizer.param_needs_quantization(module, name))

    def keeps_fp32_under(self, quantizer: Any) -> bool:
        return True

    def takes_multi_device_maps(self, quanto: bool) -> bool:
        return True


class OwnFamily(ModelFamily):
    """A model saved in this library's format (an `OwnModel`): built from its pydantic config, its declared ties
    redone, its keys always checked; the owners' quantizers do not apply to it."""

    name = "own"
    quantizable = False
    reads_single_files = False
    checks_every_checkpoint = True

    def weights_name(self, cls: type) -> str:
        return cls.weights_name

    def construct(self, cls: type, folder: Path) -> nn.Module:
        _require_config(folder)
        return cls(read_config(folder, cls.config_class))

    def retie(self, module: nn.Module) -> None:
        tie_weights(module, type(module)._tied_weights_keys)

    def declared_ties(self, module: nn.Module) -> Mapping[str, str]:
        return type(module)._tied_weights_keys or {}


class NonModuleFamily(ModelFamily):
    """A tokenizer, scheduler, processor...: read by its own `from_pretrained(folder)`, never planned."""

    name = "non_module"
    is_module = False
    quantizable = False
    reads_single_files = False

    def from_pretrained(self, cls: type, source: Path | str, *, dtype: torch.dtype | None, **arguments: Any) -> Any:
        return cls.from_pretrained(source)


DIFFUSERS, TRANSFORMERS, OWN, NON_MODULE = ModelFamily(), TransformersFamily(), OwnFamily(), NonModuleFamily()


class Family:
    """The families by name, for callers that name one (`build_component(..., family=Family.DIFFUSERS)`)."""

    DIFFUSERS, TRANSFORMERS, OWN, NON_MODULE = DIFFUSERS, TRANSFORMERS, OWN, NON_MODULE


def family_of(cls: type) -> ModelFamily:
    """The family of a component class, resolved once: by the library it comes from, else by its base class (a
    user's model is a diffusers `ModelMixin` + `ConfigMixin`, or a transformers `PreTrainedModel`)."""
    if isinstance(cls, type) and issubclass(cls, OwnModel):
        return OWN
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return NON_MODULE
    top_level = cls.__module__.split(".")[0]
    if top_level == "diffusers":
        return DIFFUSERS
    if top_level == "transformers":
        return TRANSFORMERS
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    if issubclass(cls, ModelMixin):
        return DIFFUSERS
    if issubclass(cls, PreTrainedModel):
        return TRANSFORMERS
    raise FolderError(
        f"{cls.__module__}.{cls.__name__} is an nn.Module but neither a diffusers ModelMixin (with ConfigMixin) nor "
        "a transformers PreTrainedModel, so it cannot be built from a config.json; derive it from "
        "diffusers.ModelMixin and diffusers.ConfigMixin."
    )


def weights_name_for(cls: type) -> str:
    """The weight-file stem of a module class: transformers' "model", diffusers' name, or our class's own."""
    return family_of(cls).weights_name(cls)


def _require_config(folder: Path) -> None:
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise WeightsNotFoundError(f"{config_path} not found: component folder {folder.name!r} needs its config.json.")


__all__ = ["DIFFUSERS", "Family", "ModelFamily", "NON_MODULE", "OWN", "OwnModel", "TRANSFORMERS", "family_of",
           "weights_name_for"]

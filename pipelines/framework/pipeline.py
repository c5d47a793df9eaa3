"""Pipeline: the base class of every pipeline, and the generic pipeline loaded from any folder. Its offload methods
are refused on a device-mapped pipeline, and two hook techniques do not mix: `reset_device_map()` first."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hooks import (
    GroupOffloadingConfig,
    ModelOffloadChain,
    ModelOffloadConfig,
    OffloadConflictError,
    SequentialOffloadConfig,
    TECHNIQUES,
    Technique,
    apply_to_each,
    execution_place,
)

from ..errors import CallError
from ..folder.class_registry import library_class
from ..folder.components import PipelineComponents, module_dtype, module_execution_device, save_pipeline
from ..folder.sources import LOAD_PATTERNS, PICKLE_PATTERNS, PLAN_PATTERNS
from ..hf.quiet import quiet
from ..loading.request import (
    Entry,
    LoadOptions,
    LoadRequest,
    PIPELINE_LOAD,
    PIPELINE_PLAN,
    Scope,
    entry_signature,
    resolve_request,
)
from ..loading.pipeline_loader import load_pipeline, plan_folder
from ..loading.run_check import placement_report


@library_class
class Pipeline(PipelineComponents):
    """Subclass it: declare `model_graph = [("encoder", "denoiser"), ...]`, take the components as constructor
    arguments and call `self.register_components(...)`. Used directly, `Pipeline.from_pretrained(folder)` loads
    any folder as a generic pipeline."""

    _model_offload: ModelOffloadChain | None = None

    def set_progress_bar_config(self, **config: Any) -> None:
        """diffusers' switch for the step bar of a call: tqdm keywords, e.g. `disable=True` to hide it,
        `desc="Sampling"`, `leave=False`. Replaces the previous config."""
        self._progress_bar_config = dict(config)

    def progress_bar(self, iterable=None, *, total: int | None = None) -> tqdm:
        """The bar a pipeline's `__call__` wraps its steps in. By default it shows on terminals and notebooks
        only (tqdm's `disable=None`), like the load bar."""
        config = {"desc": "Denoising", "unit": "step", "disable": None,
                  **getattr(self, "_progress_bar_config", {})}
        return tqdm(iterable, total=total, **config)

    def save_pretrained(self, save_directory: str | Path, *, max_shard_size: int | str = "5GB",
                        variant: str | None = None) -> None:
        """Write model_index.json and one subfolder per component, atomically and quietly."""
        with quiet():
            save_pipeline(self, Path(save_directory), max_shard_size=max_shard_size, variant=variant)

    @classmethod
    @entry_signature(PIPELINE_LOAD, rest="components")
    def from_pretrained(cls, pretrained: str | Path, **keywords: Any):
        """Load a pipeline folder or hub id; with `device_map`, plan on meta then stream weights to the plan.

        `device_map`: None (the CPU, no plan), a strategy, a dict {component: device | {submodule: device}}, one device,
        or a saved plan (a `placement.Plan`, its JSON's path, or a flat `hf_device_map`). `torch_dtype`: a dtype or
        {component: dtype, "default": dtype}. `offload_folder` permits planning onto "disk" (weights read from the
        checkpoint's own files). `components` replace saved ones by name; one that carries a device map is pinned.
        `call` (e.g. `{"height": 1024, "width": 1024}`) plans activation memory. A folder naming a diffusers pipeline
        class loads as that class unless `generic=True`. `trust_remote_code` lets model_index.json name modules to
        import. `quantization_config` quantizes components as they load, `layerwise_casting` stores Linear/Conv weights
        in fp8, `pin` keeps passed-in components where they are. A single-file checkpoint as `pretrained` takes
        `config=` the folder of its pipeline's configs. Pickle weights are read only on `use_safetensors=False` without
        `device_map`, by their owner library. diffusers' other loading keywords are accepted or refused by name; any
        other keyword that is not a component is an error naming the closest argument."""
        request, components = _request(cls, pretrained, keywords, entry=PIPELINE_LOAD)
        return load_pipeline(cls, request, passed=components, generic=request.options.generic)

    @classmethod
    @entry_signature(PIPELINE_PLAN, rest="components")
    def plan_placement(cls, pretrained: str | Path, **keywords: Any):
        """The `placement.Plan` that `from_pretrained` with the same keywords follows (default
        `device_map="balanced"`); builds on meta and reads no weights."""
        request, components = _request(cls, pretrained, keywords, entry=PIPELINE_PLAN)
        return plan_folder(cls, request, passed=components, generic=request.options.generic)

    def placement_report(self) -> str:
        """Measured vs predicted seconds per component of the first calls since `from_pretrained(device_map=...)`
        placed the pipeline; a figure off by more than 20% corrects this machine's profile (see
        `pipelines.loading.run_check`). A CallError when the pipeline is not placed."""
        return placement_report(self)

    def enable_model_cpu_offload(self, device: torch.device | int | str | None = None) -> None:
        """Whole components move to `device` when called, in model-graph order; the previous one goes back.

        The graph's chain is closed into a ring, so a new call sends the last component of the previous call back;
        components outside it go back at `maybe_free_model_hooks()`."""
        self._refuse_offload_when_device_mapped("enable_model_cpu_offload")
        in_graph = {name for edge in self.model_graph for name in edge}
        modules = self.module_components  # in execution order
        chain = [module for name, module in modules.items() if name in in_graph]
        standalone = [module for name, module in modules.items() if name not in in_graph]
        apply = TECHNIQUES[Technique.MODEL_OFFLOAD].apply  # a chain: one handle for all (standalone ride along)
        self._model_offload = apply(chain, ModelOffloadConfig(execution_device=device), standalone=standalone)

    def enable_sequential_cpu_offload(self, device: torch.device | int | str | None = None) -> None:
        """Every layer's weights stay in CPU RAM and visit `device` only while it runs (least memory, slowest)."""
        self._refuse_offload_when_device_mapped("enable_sequential_cpu_offload")
        config = SequentialOffloadConfig(execution_device=execution_place(device))
        apply_to_each(Technique.SEQUENTIAL_OFFLOAD, self.module_components, lambda name: config)

    def enable_group_offload(
        self,
        onload_device: torch.device | int | str | None = None,
        offload_type: str = "block_level",
        num_blocks_per_group: int = 1,
        use_stream: bool = False,
        offload_to_disk_path: str | os.PathLike | None = None,
    ) -> None:
        """Group-offload every module component (see `hooks.apply_group_offloading`).

        `onload_device=None` means accelerator 0, or the CPU without one. With `offload_to_disk_path`, each
        component writes its groups under `<path>/<component name>/`.
        """
        self._refuse_offload_when_device_mapped("enable_group_offload")
        onload = execution_place(onload_device)  # the place: a virtual accelerator stays an accelerator

        def config_for(name: str) -> GroupOffloadingConfig:
            folder = None if offload_to_disk_path is None else os.path.join(os.fspath(offload_to_disk_path), name)
            return GroupOffloadingConfig(onload_device=onload, offload_type=offload_type,
                                         num_blocks_per_group=num_blocks_per_group, use_stream=use_stream,
                                         offload_to_disk_path=folder)

        apply_to_each(Technique.GROUP_OFFLOAD, self.module_components, config_for)

    def maybe_free_model_hooks(self) -> None:
        """After a call with model offload: send every component back to the CPU (no-op otherwise).

        A pipeline's `__call__` ends with it (TextToImagePipeline's does, also when the call raised); call it
        yourself after running components directly."""
        if self._model_offload is not None:
            self._model_offload.offload_all()

    def enable_vae_slicing(self) -> None:
        """Decode one sample of the batch at a time: saves activation memory for batches > 1, nothing for 1."""
        self._vae_feature("enable_slicing")()

    def disable_vae_slicing(self) -> None:
        self._vae_feature("disable_slicing")()

    def enable_vae_tiling(self, tile_sample_size: int | None = None, overlap_factor: float | None = None) -> None:
        """Decode one image as overlapping spatial tiles, blended; images no larger than a tile are not tiled."""
        options = {"tile_sample_size": tile_sample_size, "overlap_factor": overlap_factor}
        self._vae_feature("enable_tiling")(**{key: value for key, value in options.items() if value is not None})

    def disable_vae_tiling(self) -> None:
        self._vae_feature("disable_tiling")()

    def _refuse_offload_when_device_mapped(self, method: str) -> None:
        if self.hf_device_map is not None:
            raise OffloadConflictError(
                f"{type(self).__name__}.{method}() on a device-mapped pipeline (hf_device_map="
                f"{self.hf_device_map}) would fight its placement hooks; call pipe.reset_device_map() first."
            )

    def _vae_feature(self, method: str) -> Callable:
        vae = self.components.get("vae")
        feature = getattr(vae, method, None)
        if not callable(feature):
            what = "has no vae component" if vae is None else f"has a vae ({type(vae).__name__}) without {method}()"
            raise CallError(f"{type(self).__name__} {what}; VAE slicing/tiling needs an AutoencoderKL-like vae.")
        return feature


def _request(cls: type, pretrained: str | Path, keywords: dict[str, Any], *,
             entry: Entry) -> tuple[LoadRequest, dict[str, Any]]:
    """The request both entries make from the same keywords (a plan fetches configs and headers only), and the
    components passed in."""
    options, components = LoadOptions.take(keywords, entry=entry, label=f"{cls.__name__}.{entry.method}")
    request = resolve_request(pretrained, options, scope=Scope.PIPELINE,
                              allow_patterns=PLAN_PATTERNS if entry.plans else LOAD_PATTERNS,
                              pickle_patterns=PICKLE_PATTERNS)
    return request, components


__all__ = ["Pipeline", "module_dtype", "module_execution_device"]

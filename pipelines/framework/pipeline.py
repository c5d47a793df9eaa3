"""Pipeline: the base class of every pipeline, and used directly, a generic pipeline loaded from any folder.

Its state (components, model graph, placement) lives in `folder.components.PipelineComponents`; this class adds
the memory methods (`memory`) and the folder entry points, which hand over to `pipelines.loading` (a request
resolved once, then `load_pipeline` / `plan_folder`) and `folder.pipeline_saving`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from ..folder.class_registry import library_class
from ..folder.components import PipelineComponents, module_dtype, module_execution_device
from ..folder.pipeline_saving import save_pipeline
from ..folder.sources import LOAD_PATTERNS, PICKLE_PATTERNS, PLAN_PATTERNS
from ..hf.hf_spellings import chosen_dtype, download_options, pickle_opt_in
from ..hf.loading_keywords import take_foreign_keywords
from ..hf.quiet import quiet
from ..loading.pipeline_loader import load_pipeline, plan_folder
from ..loading.request import Scope, resolve_request
from .memory import PipelineMemoryMixin


@library_class
class Pipeline(PipelineMemoryMixin, PipelineComponents):
    """Subclass it: declare `model_graph = [("encoder", "denoiser"), ...]`, take the components as constructor
    arguments and call `self.register_components(...)`. Used directly, `Pipeline.from_pretrained(folder)` loads
    any folder as a generic pipeline."""

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
        """Write model_index.json and one subfolder per component, atomically (see `saving`); quietly (the
        components' own writers draw no bars: `hf.quiet`)."""
        with quiet():
            save_pipeline(self, Path(save_directory), max_shard_size=max_shard_size, variant=variant)

    @classmethod
    def from_pretrained(cls, pretrained: str | Path, *, device_map=None, max_memory=None, torch_dtype=None,
                        variant: str | None = None, offload_folder: str | Path | None = None,
                        call: Mapping[str, Any] | None = None, progress: bool = True, generic: bool = False,
                        trust_remote_code: bool = False, dtype=None, use_safetensors: bool | None = None,
                        local_files_only: bool = False, revision: str | None = None, token: str | bool | None = None,
                        cache_dir: str | Path | None = None, quantization_config: Any = None,
                        layerwise_casting: Mapping[str, Any] | None = None, pin: Sequence[str] = (),
                        config: str | Path | None = None, **components: Any):
        """Load a pipeline folder or hub id; with `device_map`, plan on meta then stream weights to the plan.

        `device_map`: None (everything on the CPU, no plan), "balanced", "sequential", "balanced_low_0", "auto",
        a dict {component: device | {submodule: device}}, or one device. `torch_dtype`: a dtype or
        {component: dtype, "default": dtype}. `offload_folder` permits planning onto "disk"; disk-offloaded
        weights are read from the checkpoint's own safetensors files (nothing is copied). `components` replaces
        saved components by name: a plain one is sized and placed with the rest (never cast), one that already
        carries a device map is pinned where it is. `call` (e.g. `{"height": 1024, "width": 1024}`) makes the
        plan account for activation memory where the pipeline knows its inputs (`activation_inputs`).

        `device_map` may also be a saved plan: a `placement.Plan`, the path of its JSON, or a flat
        `hf_device_map` with dotted keys; the placement it describes is reproduced.
        A folder whose model_index.json names a diffusers pipeline class (written by diffusers) loads, through
        `Pipeline` itself, as an instance of that class (e.g. a callable `diffusers.FluxPipeline`), placed by
        this library; `generic=True` loads it as a generic `Pipeline` instead (each component an attribute).
        `trust_remote_code`: a folder's model_index.json may name classes by module path; only this library's,
        diffusers', transformers', registered (`pipelines.register_class`) and passed classes are used, and no
        module is imported, unless this is True (then the named modules are imported: their code runs).
        diffusers' spellings work too (`hf_spellings`): `dtype=` for `torch_dtype=`; `use_safetensors`,
        `local_files_only`, `revision`, `token`, `cache_dir` for the Hub download. Pickle weights (a
        `pytorch_model.bin` only) are refused with or without a device map; `use_safetensors=False` with
        `device_map=None` is the explicit opt-in that lets their owner library read them (`weights_only=True`).
        diffusers' other loading keywords (`low_cpu_mem_usage`, `provider_options`, ...) are accepted where each
        load here does what they ask anyway, refused by name with the reason otherwise (`hf.loading_keywords`);
        any other keyword that is not a component is an error naming the closest argument ("did you mean
        max_memory?").

        Formats of their own: `quantization_config` (a diffusers `PipelineQuantizationConfig`, or `{component:
        config}` with each library's own config) quantizes components as they load, through their owner's
        quantizer, planned at their quantized size (pre-quantized folders are read as such without it);
        `layerwise_casting={"transformer": torch.float8_e4m3fn}` stores Linear/Conv weights in fp8 and computes
        in `torch_dtype`, planned at the stored size; `pin=["transformer"]` keeps a passed-in component where it is
        (one whose own map puts weights on an accelerator is kept there anyway). A single-file checkpoint
        (`.safetensors` of an original layout, or `.gguf`) as `pretrained`, with `config=` the folder or Hub id of
        its pipeline's configs: the diffusers models it holds are read from it by diffusers' `from_single_file`
        (planned first, on meta), the other components from `config`.
        """
        components = take_foreign_keywords(components, entry=f"{cls.__name__}.from_pretrained")
        allow_pickle = pickle_opt_in(use_safetensors, device_map)
        hub = download_options(use_safetensors=None if allow_pickle else use_safetensors, revision=revision,
                               token=token, cache_dir=cache_dir, local_files_only=local_files_only)
        request = resolve_request(pretrained, allow_patterns=LOAD_PATTERNS + (PICKLE_PATTERNS if allow_pickle else []),
                                  hub=hub,
                                  scope=Scope.PIPELINE, device_map=device_map,
                                  torch_dtype=chosen_dtype(torch_dtype, dtype), max_memory=max_memory, variant=variant,
                                  offload_folder=offload_folder, call=call, progress=progress,
                                  trust_remote_code=trust_remote_code, quantization_config=quantization_config,
                                  layerwise_casting=layerwise_casting, pin=pin, config=config,
                                  allow_pickle=allow_pickle)
        return load_pipeline(cls, request, passed=components, generic=generic)

    @classmethod
    def plan_placement(cls, pretrained: str | Path, *, device_map="balanced", max_memory=None, torch_dtype=None,
                       variant: str | None = None, offload_folder: str | Path | None = None,
                       call: Mapping[str, Any] | None = None, generic: bool = False, trust_remote_code: bool = False,
                       dtype=None, local_files_only: bool = False, revision: str | None = None,
                       token: str | bool | None = None, cache_dir: str | Path | None = None,
                       quantization_config: Any = None, layerwise_casting: Mapping[str, Any] | None = None,
                       pin: Sequence[str] = (), config: str | Path | None = None, **components: Any):
        """The `placement.Plan` that `from_pretrained` would follow; builds on meta and reads no weights (nor runs
        a folder's code: `trust_remote_code` as in `from_pretrained`). Quantized components are sized as their
        quantizer will load them, layerwise-cast ones at their stored size (see `from_pretrained`)."""
        components = take_foreign_keywords(components, entry=f"{cls.__name__}.plan_placement")
        hub = download_options(use_safetensors=None, revision=revision, token=token, cache_dir=cache_dir,
                               local_files_only=local_files_only)
        request = resolve_request(pretrained, allow_patterns=PLAN_PATTERNS, hub=hub, scope=Scope.PIPELINE,
                                  device_map=device_map, torch_dtype=chosen_dtype(torch_dtype, dtype),
                                  max_memory=max_memory, variant=variant, offload_folder=offload_folder, call=call,
                                  trust_remote_code=trust_remote_code, quantization_config=quantization_config,
                                  layerwise_casting=layerwise_casting, pin=pin, config=config)
        return plan_folder(cls, request, passed=components, generic=generic)


__all__ = ["Pipeline", "module_dtype", "module_execution_device"]

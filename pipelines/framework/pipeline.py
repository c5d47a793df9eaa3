"""Pipeline: the base class of every pipeline, and used directly, a generic pipeline loaded from any folder.

Its state (components, model graph, placement) lives in `folder.components.PipelineComponents`; this class adds
the memory methods (`memory`) and the folder entry points, which hand over to `pipelines.loading` (a request
resolved once, then `load_pipeline` / `plan_folder`) and `folder.pipeline_saving`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..folder.class_registry import library_class
from ..folder.components import PipelineComponents, module_dtype, module_execution_device, save_pipeline
from ..folder.sources import LOAD_PATTERNS, PICKLE_PATTERNS, PLAN_PATTERNS
from ..hf.quiet import quiet
from ..loading.options import PIPELINE_LOAD, PIPELINE_PLAN, Entry, LoadOptions, Scope, entry_signature
from ..loading.pipeline_loader import load_pipeline, plan_folder
from ..loading.request import LoadRequest, resolve_request
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
    @entry_signature(PIPELINE_LOAD, rest="components")
    def from_pretrained(cls, pretrained: str | Path, **keywords: Any):
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
        request, components = _request(cls, pretrained, keywords, entry=PIPELINE_LOAD)
        return load_pipeline(cls, request, passed=components, generic=request.options.generic)

    @classmethod
    @entry_signature(PIPELINE_PLAN, rest="components")
    def plan_placement(cls, pretrained: str | Path, **keywords: Any):
        """The `placement.Plan` that `from_pretrained` with the same keywords follows (the same `LoadOptions`,
        planned by the same function); without `device_map`, the plan of `device_map="balanced"`. Builds on meta
        and reads no weights (nor runs a folder's code: `trust_remote_code` as in `from_pretrained`). Quantized
        components are sized as their quantizer will load them, layerwise-cast ones at their stored size."""
        request, components = _request(cls, pretrained, keywords, entry=PIPELINE_PLAN)
        return plan_folder(cls, request, passed=components, generic=request.options.generic)


def _request(cls: type, pretrained: str | Path, keywords: dict[str, Any], *,
             entry: Entry) -> tuple[LoadRequest, dict[str, Any]]:
    """The request both entries make from the same keywords (only the files fetched from the Hub differ: a
    plan reads configs and headers), and the components passed in."""
    options, components = LoadOptions.take(keywords, entry=entry, label=f"{cls.__name__}.{entry.method}")
    request = resolve_request(pretrained, options, scope=Scope.PIPELINE,
                              allow_patterns=PLAN_PATTERNS if entry.plans else LOAD_PATTERNS,
                              pickle_patterns=PICKLE_PATTERNS)
    return request, components


__all__ = ["Pipeline", "module_dtype", "module_execution_device"]

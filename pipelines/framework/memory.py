"""Memory-saving methods of Pipeline (model/sequential/group offload, VAE slicing and tiling).

The offload methods apply rows of the technique table (`hooks.TECHNIQUES`) to every module component. They
are refused on a device-mapped pipeline (call `reset_device_map()` first), and two techniques that install
hooks do not mix: undo one (`reset_device_map()` removes every hook) before enabling another. Enabling the
same technique again replaces it. With `device=None` and no accelerator, offloading "executes" on the CPU:
nothing moves, but every hook runs, so the code path is the same as on a GPU machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from hooks import (
    TECHNIQUES,
    GroupOffloadingConfig,
    ModelOffloadChain,
    ModelOffloadConfig,
    OffloadConflictError,
    SequentialOffloadConfig,
    Technique,
    apply_to_each,
    execution_place,
)
from ..errors import CallError


class PipelineMemoryMixin:
    """Mixed into `pipelines.Pipeline`; each method installs hooks that `reset_device_map()` removes."""

    _model_offload: ModelOffloadChain | None = None

    # ------------------------------------------------------------------------------------------- offload
    def enable_model_cpu_offload(self, device: torch.device | int | str | None = None) -> None:
        """Whole components move to `device` when called, in model-graph order; the previous one goes back.

        Components in the model graph are chained (and the chain closed into a ring, so a new call sends the
        last component of the previous call back); components outside it are offloaded on their own and go
        back at `maybe_free_model_hooks()`.
        """
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

    # ----------------------------------------------------------------------------------------------- VAE
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

    # ------------------------------------------------------------------------------------------- helpers
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


__all__ = ["PipelineMemoryMixin"]

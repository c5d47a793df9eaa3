"""PipelineComponents: named components (models and non-models), the model graph and the placement state.

This is the state that loading (`pipelines.loading`), saving (`pipeline_saving`) and the offload techniques
(`framework.memory`) act on; `framework.pipeline.Pipeline` adds the folder entry points (`from_pretrained`,
`plan_placement`, `save_pretrained`) and the memory methods on top, so those modules import this one and never
the class that calls them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from hooks import OFFLOADING, OffloadConflictError, group_offloading_session, techniques_on
from placement.devices import torch_device
from placement.errors import PlanError
from placement.graph import build_graph, execution_order

from ..errors import FolderError
from .component_origins import origins_of, restore_components

OFFLOAD_TECHNIQUES = OFFLOADING  # read from the technique table: the rows whose hooks hold their own weights


class PipelineComponents:
    """The state of every pipeline: components, model graph, hf_device_map and the plan it was loaded with.

    `model_graph` lists edges `(producer, consumer)` between module components; its topological order is the
    execution order that planning and model offload follow. Edges that touch an optional component registered
    as None are ignored; an edge naming a component that was never registered is an error.
    """

    model_graph: ClassVar[Sequence[tuple[str, str]]] = ()

    def __init__(self) -> None:  # no components of its own: see `is_generic`
        self._component_names: list[str] = []
        self.hf_device_map: dict[str, Any] | None = None
        # The placement.Plan the pipeline was loaded with (None when not device-mapped); kept for inspection.
        self.placement_plan = None

    # ----------------------------------------------------------------------------------------- components
    def register_components(self, **named: Any) -> None:
        """Register components (modules, non-modules, or None for an absent optional one) as attributes."""
        for name, component in named.items():
            if name.startswith("_") or not name.isidentifier():
                raise FolderError(f"Component name {name!r} must be a public Python identifier.")
            if name not in self._component_names:
                self._component_names.append(name)
            setattr(self, name, component)

    @property
    def components(self) -> dict[str, Any]:
        """Every registered component by name (modules, non-modules, None for absent ones), in registration order."""
        return {name: getattr(self, name) for name in self._component_names}

    @property
    def module_components(self) -> dict[str, nn.Module]:
        """The nn.Module components, in execution order."""
        components = self.components
        return {name: components[name] for name in self.execution_order}

    @property
    def graph_edges(self) -> list[tuple[str, str]]:
        """The model graph's edges between present module components (edges touching a None component dropped)."""
        components = self.components
        edges = []
        for producer, consumer in self.model_graph:
            for name in (producer, consumer):
                if name not in components:
                    raise FolderError(
                        f"{type(self).__name__}.model_graph names {name!r}, which is not a registered component "
                        f"(registered: {', '.join(components) or 'none'})."
                    )
            if isinstance(components[producer], nn.Module) and isinstance(components[consumer], nn.Module):
                edges.append((producer, consumer))
        return edges

    @property
    def execution_order(self) -> list[str]:
        """Module component names in topological order of the model graph; ties keep registration order."""
        modules = [name for name, obj in self.components.items() if isinstance(obj, nn.Module)]
        try:
            return execution_order(build_graph(modules, self.graph_edges), modules)
        except PlanError as error:
            raise FolderError(f"{type(self).__name__}.model_graph: {error}") from error

    # ------------------------------------------------------------------------------------------ devices
    def component_execution_device(self, name: str) -> torch.device:
        """Where component `name` computes: its plan's execution device, an offload hook's, or its weights'."""
        if self.placement_plan is not None and name in self.placement_plan.components:
            return _torch_device(self.placement_plan.components[name].execution_device)
        return module_execution_device(self.components[name])

    @property
    def device(self) -> torch.device:
        """The execution device of the first module component (where a call starts)."""
        order = self.execution_order
        return self.component_execution_device(order[0]) if order else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return module_dtype(*self.module_components.values())

    def to(self, *args, **kwargs) -> "PipelineComponents":
        """Move/cast every module component like `nn.Module.to`; refused on a device-mapped pipeline."""
        self._refuse_if_device_mapped(".to()")
        self._refuse_if_offloaded(".to()")
        # The argument parser nn.Module.to itself uses: .to accepts exactly what a module's .to accepts.
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for module in self.module_components.values():
            module.to(device=device, dtype=dtype)
        return self

    def reset_device_map(self) -> None:
        """Undo the placement: every hook it added removed, the weights the load read brought to the CPU (disk
        and offloaded ones read back), each model's `hf_device_map` as it was before, and a component passed in
        back as it came (its device, its map, its owner's hooks: see `component_origins`); then `.to()` and the
        offload methods work."""
        restore_components(self.module_components, origins_of(self))
        self.hf_device_map = None
        self.placement_plan = None

    def _refuse_if_device_mapped(self, operation: str) -> None:
        if self.hf_device_map is not None:
            raise OffloadConflictError(
                f"{operation} on a device-mapped {type(self).__name__} (hf_device_map={self.hf_device_map}) "
                "would break its placement; call pipe.reset_device_map() first."
            )

    def _refuse_if_offloaded(self, operation: str) -> None:
        """Offload hooks keep their own copies of the weights (a CPU state dict, group stores): moving or casting
        the module under them would leave the two disagreeing, and the next call would fail or run stale."""
        on = {name: sorted(t.value for t in techniques_on(module) if t in OFFLOAD_TECHNIQUES)
              for name, module in self.module_components.items()}
        on = {name: found for name, found in on.items() if found}
        if on:
            listed = ", ".join(f"{name} ({', '.join(found)})" for name, found in on.items())
            raise OffloadConflictError(
                f"{operation} on {type(self).__name__} while offloading is on: {listed}. The offload hooks hold "
                "their own copies of the weights; call pipe.reset_device_map() to remove them, then .to(...), "
                "then enable offloading again."
            )

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for name, component in self.components.items():
            lines.append(f"  {name}: {type(component).__name__ if component is not None else None}")
        lines.append(f"  hf_device_map={self.hf_device_map}")
        return "\n".join(lines) + "\n)"


def module_execution_device(module: Any) -> torch.device:
    """Where an offloaded module computes (group offload's onload device, an accelerate hook's execution
    device), else its first weight's device."""
    if not isinstance(module, nn.Module):
        return torch.device("cpu")
    session = group_offloading_session(module)
    if session is not None:
        return session.onload_device
    for submodule in module.modules():
        hook = getattr(submodule, "_hf_hook", None)
        for candidate in (hook, *getattr(hook, "hooks", ())):  # a hook, or the hooks of a SequentialHook
            device = getattr(candidate, "execution_device", None)
            if device is not None:
                return _torch_device(device) if isinstance(device, int) else torch.device(device)
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def module_dtype(*modules: nn.Module) -> torch.dtype:
    """The dtype `modules` compute in: that of the first floating parameter (float32 if there is none); fp8 ones
    are storage only (layerwise casting upcasts them per layer), never what a module computes in."""
    floats = (tensor.dtype for module in modules for tensor in module.parameters()
              if tensor.is_floating_point() and tensor.dtype.itemsize > 1)
    return next(floats, torch.float32)


def _torch_device(device) -> torch.device:
    return torch_device("cpu" if device == "disk" else device)


def is_generic(cls: type) -> bool:
    """A pipeline class without a constructor of its own (`pipelines.Pipeline` itself): loaded generically,
    every component of the folder an attribute, rather than through its constructor's arguments."""
    return cls.__init__ is PipelineComponents.__init__

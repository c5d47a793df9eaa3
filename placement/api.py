"""`placement.plan()`: size the components, resolve the budgets and the graph, run the strategy, build the Plan."""

from __future__ import annotations

import warnings
from typing import Mapping, Optional

from torch import nn

from .budgets import MARGIN_DESCRIPTION, Budgets, resolve_budgets
from .devices import Device
from .graph import build_graph, crossing_edges, execution_order
from .memory_model import Ledger
from .plan import Plan, PlanInputs
from .planning_errors import ComponentError, StrategyError
from .sizes import parse_size
from .sizing import dtype_for, size_module
from .streaming import streaming_working_set
from .strategies import (
    ComponentRequest,
    Context,
    CostModel,
    Placements,
    StrategyKind,
    StrategySpec,
    parse_strategy,
    place_free_components,
)
from .strategies.pinned import check_budgets_exist, enforce, normalize_pins, over_budget, place_pinned

Pin = Device | Mapping[str, Device]


def plan(
    components: Mapping[str, nn.Module],
    *,
    max_memory: Optional[Mapping] = None,
    strategy="balanced",
    graph=None,
    dtype=None,
    offload_folder=None,
    activations: Optional[Mapping[str, int]] = None,
    pinned: Optional[Mapping[str, Pin]] = None,
) -> Plan:
    """Plan where each module component lives and runs. Builds nothing, loads nothing.

    components: name -> nn.Module (usually on meta), in pipeline order.
    max_memory: {0: "24GiB", 1: 24 * 2**30, "cpu": "64GiB", "disk": ...}, used exactly as given; None detects
        free accelerator memory and available RAM minus a margin (see `placement.budgets`).
    strategy: "balanced" (default), "auto" (= balanced), "sequential", "balanced_low_0", a dict
        {component: device | {submodule: device}} (pinned; the rest balanced), or one device.
    graph: a networkx.DiGraph or a list of (producer, consumer) edges; None chains the components in order.
    dtype: a torch dtype or {component: dtype, "default": dtype}; None keeps each tensor's dtype.
    offload_folder: where disk-offloaded weights go; without it, needing the disk is an error.
    activations: {component: peak activation bytes} for the call the user will make; None plans weights
        only (the plan says so).
    pinned: components already placed (e.g. passed in dispatched): used as given, counted against the budgets.
    """
    modules = _module_components(components)
    spec = parse_strategy(strategy)
    budgets = resolve_budgets(max_memory)
    model_graph = build_graph(list(modules), graph)
    order = execution_order(model_graph, list(modules))
    activation_bytes = _activations(activations, modules)
    requests = {
        name: _request(name, modules[name], dtype_for(dtype, name), activation_bytes.get(name), position)
        for position, name in enumerate(order)
    }
    # A dict strategy's pins, validated even when the strategy degrades below (a degraded one places none).
    asked = normalize_pins(spec.pins, requests, source="device_map") if spec.kind is StrategyKind.DICT else {}
    notes: list[str] = []
    spec = _degrade_without_accelerators(spec, budgets, notes, detected=max_memory is None)
    ledger = Ledger(budgets, activations_accounted=activations is not None)
    context = Context(has_offload_folder=offload_folder is not None)
    placements = Placements()
    _place_pins({} if spec.degraded else asked, pinned, requests, ledger, context, placements, notes)
    free = [request for name, request in requests.items() if name not in placements.by_name]
    place_free_components(spec, free, ledger, context, placements, notes, CostModel.build(model_graph, free))
    by_name = placements.by_name
    return Plan(
        strategy=spec.label,
        components={name: by_name[name].plan for name in order},
        devices=ledger.device_plans(),
        crossing_edges=crossing_edges(model_graph, {name: by_name[name].plan.execution_device for name in order}),
        fallbacks=[by_name[name].fallback for name in order if by_name[name].fallback is not None],
        activations_accounted=activations is not None,
        warnings=notes,
        budget_margin=MARGIN_DESCRIPTION if budgets.detected else "",
        placement_order=list(by_name),
        inputs=PlanInputs.record(strategy=strategy, dtype=dtype, offload_folder=offload_folder,
                                 max_memory=None if max_memory is None else budgets.given()),
    )


def _request(name: str, module: nn.Module, dtype, activation: Optional[int], position: int) -> ComponentRequest:
    size = size_module(module, dtype)
    return ComponentRequest(
        name=name, module=module, size=size, dtype=dtype, activation=activation, position=position,
        streamed=streaming_working_set(module, size),
    )


def _module_components(components) -> dict[str, nn.Module]:
    if not isinstance(components, Mapping):
        raise ComponentError(
            f"components must be a mapping of names to nn.Modules, got {type(components).__name__}."
        )
    others = {name: type(value).__name__ for name, value in components.items() if not isinstance(value, nn.Module)}
    if others:
        raise ComponentError(
            f"Only nn.Module components are placed; these are not modules: {others}. "
            "Leave tokenizers, schedulers and other non-module components out of plan()."
        )
    return {str(name): module for name, module in components.items()}


def _activations(activations, modules: Mapping[str, nn.Module]) -> dict[str, int]:
    if activations is None:
        return {}
    if not isinstance(activations, Mapping):
        raise ComponentError(f"activations must be a dict {{component: bytes}}, got {activations!r}.")
    unknown = [name for name in activations if name not in modules]
    if unknown:
        raise ComponentError(
            f"activations names components that do not exist: {unknown}. The module components are "
            f"{list(modules)}."
        )
    return {name: parse_size(value) for name, value in activations.items()}


def _degrade_without_accelerators(
    spec: StrategySpec, budgets: Budgets, notes: list[str], *, detected: bool
) -> StrategySpec:
    """No accelerator to plan for: every strategy runs everything on the CPU, with ONE warning."""
    if budgets.accelerators or (spec.kind is StrategyKind.DEVICE and spec.device == "cpu"):
        return spec
    why = "no accelerator is visible" if detected else "max_memory has no integer (accelerator) keys"
    message = (
        f"No accelerator to plan for ({why}): strategy {spec.label!r} degrades to 'cpu', and every component "
        "runs on the CPU. Pass max_memory={0: '24GiB', ...} to plan for GPUs this machine does not have."
    )
    warnings.warn(message, UserWarning, stacklevel=3)
    notes.append(message)
    return StrategySpec(kind=StrategyKind.BALANCED, degraded=True)


def _place_pins(asked, pinned, requests, ledger, context, placements, notes) -> None:
    """Components already placed (`pinned`, their placement is a fact: over budget is a warning), then the
    dict strategy's pins (`asked`, normalized: a request, over an explicit budget is an error)."""
    already = normalize_pins(pinned or {}, requests, source="pinned")
    check_budgets_exist(already, ledger, source="pinned", has_offload_folder=True)
    for name, device_map in already.items():
        placements.add(place_pinned(requests[name], device_map, ledger))
    for problem, _ in over_budget(ledger, ledger.loads):
        message = f"Components passed in already placed exceed a budget: {problem}."
        warnings.warn(message, UserWarning, stacklevel=3)
        notes.append(message)
    if not asked:
        return
    both = sorted(set(asked) & set(already))
    if both:
        raise StrategyError(
            f"device_map pins {both}, which were passed in already placed; leave them out of the device_map."
        )
    check_budgets_exist(asked, ledger, source="device_map", has_offload_folder=context.has_offload_folder)
    for name, device_map in asked.items():
        placements.add(place_pinned(requests[name], device_map, ledger))
    used = {device for device_map in asked.values() for device in device_map.values()}
    enforce(ledger, used, what=f"device_map pinning {list(asked)}", notes=notes)

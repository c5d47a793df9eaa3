"""`placement.plan()`: size the components, resolve the budgets and the graph, run the strategy, build the Plan."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from torch import nn

from .budgets import MARGIN_DESCRIPTION, Budgets, resolve_budgets, with_detected_cpu_note
from .component_options import FormatLimit, TechniqueChoices, choose_techniques, kept_whole_notes
from .cost import Timing
from .devices import Device, accelerators_present, is_accelerator
from .transfers.inputs import (
    check_disk_read_bandwidth,
    check_link_bandwidth,
    check_per_run,
    check_runs_per_call,
    component_mapping,
    link_speed,
)
from .errors import DoesNotFitError, PlanError
from .graph import build_graph, crossing_edges, execution_order
from .memory_model import Ledger
from .transfers.residency import complete_transfers
from .transfers.blocks import idle_units
from .gpu_profiles import GpuProfile, choose_gpu, gpu_profile
from .machine_profile import machine_choice
from .time_model import run_seconds, short_name
from .plan_schema import ComponentPlan, Plan, PlanInputs
from .sizes import parse_size
from .sizing import dtype_for, dtype_label, size_module
from .streaming import streaming_working_set, transfer_units
from .unit_order import order_units
from .strategies import (
    ComponentRequest,
    Context,
    CostModel,
    Placements,
    StrategyKind,
    StrategyRequest,
    StrategyScope,
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
    scope: str = "pipeline",
    module_order: Optional[Mapping[str, Sequence[str]]] = None,
    runs_per_call: Optional[Mapping[str, int]] = None, link_bandwidth=None, gpu=None,
    flops_per_run: Optional[Mapping[str, int]] = None, bytes_touched_per_run: Optional[Mapping[str, int]] = None,
    disk_read_bandwidth=None, techniques: Optional[TechniqueChoices] = None,
    format_limits: Optional[Mapping[str, FormatLimit]] = None,
) -> Plan:
    """Plan where each module component (name -> nn.Module, usually on meta, in pipeline order) lives and runs.
    Builds nothing, loads nothing.

    max_memory: {0: "24GiB", "cpu": "64GiB", "disk": ...}, exactly as given; None: detected minus a margin.
    strategy: "balanced" (= "auto"), "sequential", "balanced_low_0", a dict {component: device | {submodule:
        device}} (pinned; the rest balanced), or one device. scope="model": accelerate's model-level meaning.
    graph: a networkx.DiGraph or (producer, consumer) edges; None chains the components in order.
    dtype: a torch dtype or {component: dtype, "default": dtype}; None keeps each tensor's dtype.
    offload_folder: where disk-offloaded weights go; without it, needing the disk is an error.
    activations: {component: peak activation bytes} of the call; None plans weights only (and says so).
    pinned: components passed in already placed. module_order: {component: submodule paths in call order}.
    runs_per_call: {component: runs}, e.g. {"transformer": 28}; not fitting resident, what runs most stays.
    link_bandwidth / disk_read_bandwidth: bytes/s (or "25GB") for the plan's times; None: measured or assumed.
    gpu: the profile the seconds assume ("rtx4090", "h100", "measure"); None: this machine's CUDA GPU or assumed.
    flops_per_run / bytes_touched_per_run: {component: per run at the call} (`estimate_call(...).flops`); with
        them the plan predicts seconds per call, without them only bytes.
    techniques: the memory techniques (VAE tiling/slicing) the plan may turn on where `activations` do not fit,
        with each component's peak under them (`TechniqueChoices`); the plan records those it chose.
    format_limits: {component: FormatLimit}, placements its weight format cannot run in (never planned).
    """
    modules = _module_components(components)
    _check_dtype_keys(dtype, modules)
    runs = check_runs_per_call(runs_per_call, modules)
    bandwidth = check_link_bandwidth(link_bandwidth)
    disk = None if disk_read_bandwidth is None else check_disk_read_bandwidth(disk_read_bandwidth)
    work = {name: (check_per_run(flops_per_run, modules, "flops_per_run").get(name),
                   check_per_run(bytes_touched_per_run, modules, "bytes_touched_per_run").get(name))
            for name in modules}
    profile = None if gpu is None else gpu_profile(gpu)  # a misspelt name fails before any planning
    spec = _parse_strategy(strategy, scope, modules)
    budgets = resolve_budgets(max_memory)
    model_graph = build_graph(list(modules), graph)
    order = execution_order(model_graph, list(modules))
    given = _activations(activations, modules)
    requests = _requests(modules, order, dtype, given, module_order or {}, _limits(format_limits, modules))
    # A dict strategy's pins, validated even when the strategy degrades below (a degraded one places none).
    asked = _component_pins(spec, requests, budgets, given=max_memory is not None)
    notes: list[str] = []
    spec = _degrade_without_accelerators(spec, budgets, notes, detected=max_memory is None)
    accelerators = Ledger(budgets, activations_accounted=False).accelerators
    # Without gpu=, this machine's profile (`placement calibrate`, corrected by placed runs) where there is one.
    machine = None if profile is not None else machine_choice(accelerators)
    disk_given = disk is not None or machine is None or machine.disk is None
    if machine is not None and disk is None and machine.disk is not None:
        disk = machine.disk[0]
    search = _Search(
        spec=spec, order=order, graph=model_graph, requests=requests, budgets=budgets, asked=asked, pinned=pinned,
        notes=tuple(notes), activations_accounted=activations is not None,
        context=Context(has_offload_folder=offload_folder is not None), runs=runs, work=work,
        gpu=profile if machine is None else machine.gpu, machine=machine, disk=disk, disk_given=disk_given,
        link=_search_link(bandwidth if link_bandwidth is not None else None, bandwidth, profile, machine),
        bandwidth=link_bandwidth and bandwidth,
        inputs=PlanInputs.record(strategy=strategy, dtype=dtype, offload_folder=offload_folder,
                                 max_memory=None if max_memory is None else budgets.given(),
                                 runs_per_call=runs_per_call, link_bandwidth=link_bandwidth and bandwidth,
                                 gpu=None if profile is None else profile.key))
    return choose_techniques(functools.partial(_searched, search), given, techniques)


@dataclass(frozen=True, kw_only=True)
class _Search:
    """What one search over the components needs besides their activations: `plan()` runs it once, and once more
    per technique set `techniques` offers when the plan without them does not fit (`choose_techniques`)."""

    spec: StrategySpec
    order: Sequence[str]
    graph: object
    requests: Mapping[str, ComponentRequest]
    budgets: Budgets
    asked: Mapping
    pinned: Optional[Mapping]
    notes: tuple[str, ...]
    activations_accounted: bool
    context: Context  # shared: its split cache holds across the searches of one plan() call
    runs: Mapping[str, int]
    work: Mapping[str, tuple]
    gpu: Optional[GpuProfile]
    machine: object
    disk: Optional[float]
    disk_given: bool
    link: float
    bandwidth: Optional[float]
    inputs: PlanInputs


def _searched(search: _Search, activation_bytes: Mapping[str, int]) -> Plan:
    """The Plan of one search, the components carrying `activation_bytes`."""
    requests = {name: request if activation_bytes.get(name) == request.activation
                else dataclasses.replace(request, activation=activation_bytes.get(name))
                for name, request in search.requests.items()}
    notes = list(search.notes)
    ledger = Ledger(search.budgets, activations_accounted=search.activations_accounted)
    try:
        placements = Placements()
        _place_pins({} if search.spec.degraded else search.asked, search.pinned, requests, ledger, search.context,
                    placements, notes)
        costs = _cost_model(search.graph, requests, search.runs, search.work, search.gpu, ledger.accelerators,
                            search.disk, search.link)
        state = _place_the_rest(search.spec, requests, ledger, search.context, placements, costs)
    except DoesNotFitError as error:  # what the message cannot say by itself
        raise with_detected_cpu_note(error, search.budgets)
    placed = _assemble(search.spec, search.order, search.graph, state, requests,
                       notes + list(state.warnings) + kept_whole_notes(state.by_name, requests), search.budgets,
                       search.inputs, activations_accounted=search.activations_accounted, bandwidth=search.bandwidth,
                       gpu=search.gpu, work=search.work,
                       machine_link=None if search.machine is None else search.machine.link)
    if search.disk is None:  # the assumed disk speed the plan has
        return placed
    return placed.model_copy(update={"disk_read_bandwidth": search.disk, "disk_read_bandwidth_source":
                                     "given" if search.disk_given else search.machine.disk[1]})


def _search_link(given: Optional[float], default: float, named: Optional[GpuProfile], machine) -> float:
    """The host link the search prices copies at: as given; else this machine's profile's (`machine_choice`),
    where it measured or corrected the GPU present; else the named GPU's; else the default."""
    if given is not None:
        return given
    if machine is not None:
        return default if machine.link is None else machine.link[0]
    return default if named is None else named.link_bytes_per_s


def _place_the_rest(spec, requests, ledger, context, placements, costs: CostModel):
    """The strategy over the components not pinned, then every component's transfer (`complete_transfers`)."""
    free = [request for name, request in requests.items() if name not in placements.by_name]
    state = place_free_components(StrategyRequest.build(
        spec=spec, requests=free, ledger=ledger, placed=placements.by_name, context=context, costs=costs))
    return complete_transfers(state, requests, costs.runs)


def _cost_model(model_graph, requests, runs, work, profile, accelerators, disk, link) -> CostModel:
    """The search's cost model: bytes per call by each component's runs, and seconds when FLOPs are known."""
    costs = CostModel.build(model_graph, [*requests.values()], runs)
    return dataclasses.replace(costs, timing=_timing(work, requests, profile, accelerators, costs.runs, disk, link))


def _timing(work: Mapping[str, tuple], requests, profile: Optional[GpuProfile], accelerators,
            runs: Mapping[str, int], disk: Optional[float], link: float) -> Optional[Timing]:
    """What the search predicts exposed copy seconds with (`cost.Timing`), from each component's seconds per run
    on the plan's GPU (`choose_gpu`); None without FLOPs: the objective stays bytes."""
    if all(flops is None for flops, _ in work.values()):
        return None
    gpu = choose_gpu(profile, accelerators)[0]
    seconds = {name: run_seconds(flops, touched, gpu, dtype_label(requests[name].module, requests[name].dtype))
               for name, (flops, touched) in work.items() if flops is not None}
    return Timing.build(seconds, runs, link=link, disk=disk)


def _requests(modules, order, dtype, activation_bytes, traced, limits) -> dict[str, ComponentRequest]:
    return {name: _request(name, modules[name], dtype_for(dtype, name), activation_bytes.get(name), position,
                           traced.get(name), limits.get(name)) for position, name in enumerate(order)}


def _limits(format_limits, modules: Mapping[str, nn.Module]) -> dict[str, FormatLimit]:
    given = component_mapping(format_limits, modules, "format_limits", "{component: FormatLimit}")
    wrong = {name: type(limit).__name__ for name, limit in given.items() if not isinstance(limit, FormatLimit)}
    if wrong:
        raise PlanError(f"format_limits values must be placement.FormatLimit; got {wrong}.")
    return dict(given)


def _assemble(spec, order, model_graph, state, requests, notes, budgets, inputs: PlanInputs, *,
              activations_accounted: bool, bandwidth: Optional[float], gpu: Optional[GpuProfile],
              work: Mapping[str, tuple], machine_link: Optional[tuple[float, str]] = None) -> Plan:
    """The Plan from the strategy's final state; link `bandwidth` if given, else measured where the plan moves
    weights to this machine's GPUs, else the named GPU's host link, else assumed."""
    by_name = state.by_name
    components = {name: _finished(by_name[name].plan, requests[name], work[name]) for name in order}
    profile, profile_source = choose_gpu(gpu, state.ledger.accelerators)
    link = {} if bandwidth is None else {"link_bandwidth": bandwidth, "link_bandwidth_source": "given"}
    if bandwidth is None and machine_link is not None:  # this machine's profile: measured once, or corrected
        link = {"link_bandwidth": machine_link[0], "link_bandwidth_source": machine_link[1]}
    elif bandwidth is None:
        moves = any(c.transfer is not None and c.transfer.bytes_per_call for c in components.values())
        measured = link_speed(state.ledger.accelerators, moves=moves)
        if measured is not None:
            link = {"link_bandwidth": measured[0], "link_bandwidth_source": measured[1]}
        elif gpu is not None:
            link = {"link_bandwidth": gpu.link_bytes_per_s,
                    "link_bandwidth_source": f"{short_name(gpu)}'s host link: {gpu.link_label}"}
    return Plan(
        **link, gpu=profile, gpu_source=profile_source,
        strategy=spec.label,
        components=components,
        devices=state.ledger.device_plans(),
        crossing_edges=crossing_edges(model_graph, {name: by_name[name].plan.execution_device for name in order}),
        fallbacks=[by_name[name].fallback for name in order if by_name[name].fallback is not None],
        activations_accounted=activations_accounted,
        warnings=notes,
        budget_margin=MARGIN_DESCRIPTION if budgets.detected else "",
        placement_order=list(by_name),
        map_reasons=list(state.map_reasons),
        left_empty={device: why for device, why in state.left_empty.items()
                    if not any(device in c.placed_bytes or device == c.execution_device for c in components.values())},
        inputs=inputs.model_copy(update={"accelerators_present": accelerators_present()}),  # more: simulated
    )


def _parse_strategy(strategy, scope: str, modules: Mapping[str, nn.Module]) -> StrategySpec:
    spec = parse_strategy(strategy, scope=scope)
    if spec.scope is StrategyScope.MODEL and len(modules) != 1:
        raise PlanError(f"scope='model' places one model; got {len(modules)} components: {list(modules)}.")
    return spec


def _component_pins(spec: StrategySpec, requests, budgets: Budgets, *, given: bool) -> dict:
    """A pipeline-level dict strategy's `{component: device map}` (at model scope a dict maps submodules).

    A pin to an accelerator when an explicit `max_memory` lists none is an error: degrading it to the CPU would
    silently drop what the user asked for. (Without max_memory, a machine with no GPU degrades with a warning.)"""
    if spec.kind is not StrategyKind.DICT or spec.model_level:
        return {}
    pins = normalize_pins(spec.pins, requests, source="device_map")
    absent = {name: device for name, device_map in pins.items() for device in device_map.values()
              if is_accelerator(device) and device not in budgets.accelerators}
    if given and absent and not budgets.accelerators:  # with some GPUs, pinned.check_budgets_exist says it
        raise PlanError(
            f"device_map pins {', '.join(f'{name!r} to GPU {device}' for name, device in absent.items())}, but "
            f"max_memory gives no budget for {'it' if len(set(absent.values())) == 1 else 'them'} (its devices: "
            f"{list(budgets.limits)}). Add the GPU to max_memory (e.g. {{{next(iter(absent.values()))}: '24GiB'}}) "
            "or pin to a device it lists."
        )
    return pins


def _request(name: str, module: nn.Module, dtype, activation: Optional[int], position: int,
             traced_order: Optional[Sequence[str]], limit: Optional[FormatLimit]) -> ComponentRequest:
    size = size_module(module, dtype)
    if traced_order:
        size = dataclasses.replace(size, split_units=order_units(size.split_units, traced_order))
    units = transfer_units(module, size)
    return ComponentRequest(
        name=name, module=module, size=size, dtype=dtype, activation=activation, position=position,
        streamed=streaming_working_set(module, size), units=units,
        idle=idle_units(module, units, traced_order) if traced_order else frozenset(), limit=limit,
    )


def _finished(component: ComponentPlan, request: ComponentRequest, work: tuple) -> ComponentPlan:
    """Every component states the dtype its bytes assume (requested, or its tensors' own), and what one run
    computes and touches where the caller counted it (`work`: FLOPs, bytes touched)."""
    return component.model_copy(update={"dtype": dtype_label(request.module, request.dtype),
                                        "flops_per_run": work[0], "bytes_touched_per_run": work[1]})


def _module_components(components) -> dict[str, nn.Module]:
    if not isinstance(components, Mapping):
        raise PlanError(
            f"components must be a mapping of names to nn.Modules, got {type(components).__name__}."
        )
    others = {name: type(value).__name__ for name, value in components.items() if not isinstance(value, nn.Module)}
    if others:
        raise PlanError(
            f"Only nn.Module components are placed; these are not modules: {others}. "
            "Leave tokenizers, schedulers and other non-module components out of plan()."
        )
    named = {str(name): module for name, module in components.items()}
    if len(named) != len(components):
        clashes = sorted({str(n) for n in components if sum(str(m) == str(n) for m in components) > 1})
        raise PlanError(
            f"Component names {clashes} collide once written as strings ({[repr(n) for n in components]}); "
            "a plan names components by string, so one would be dropped. Give every component a distinct name."
        )
    return named


def _check_dtype_keys(dtype, modules: Mapping[str, nn.Module]) -> None:
    """A dict dtype names components or "default": a misspelt key would be ignored without a word."""
    if not isinstance(dtype, Mapping):
        return
    unknown = sorted(str(key) for key in dtype if key != "default" and str(key) not in modules)
    if unknown:
        raise PlanError(
            f"dtype names {unknown}, which are not components of this plan; its components are {sorted(modules)}. "
            "Fix the key(s), or use 'default' for every other component."
        )


def _activations(activations, modules: Mapping[str, nn.Module]) -> dict[str, int]:
    given = component_mapping(activations, modules, "activations", "{component: bytes}")
    return {name: parse_size(value) for name, value in given.items()}


def _degrade_without_accelerators(
    spec: StrategySpec, budgets: Budgets, notes: list[str], *, detected: bool
) -> StrategySpec:
    """No accelerator to plan for: every strategy runs everything on the CPU, with ONE warning."""
    if budgets.accelerators or (spec.kind is StrategyKind.DEVICE and spec.device == "cpu"):
        return spec
    if spec.model_level and (spec.kind is StrategyKind.DICT or not detected):
        return spec  # accelerate's model-level meaning: a dict's devices exactly; given budgets: CPU, then disk
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
        raise PlanError(
            f"device_map pins {both}, which were passed in already placed; leave them out of the device_map."
        )
    check_budgets_exist(asked, ledger, source="device_map", has_offload_folder=context.has_offload_folder)
    for name, device_map in asked.items():
        placements.add(place_pinned(requests[name], device_map, ledger))
    used = {device for device_map in asked.values() for device in device_map.values()}
    enforce(ledger, used, what=f"device_map pinning {list(asked)}", notes=notes)

"""Plan module components with `placement.plan`: a pipeline's (its graph, its dtypes, pins for components passed
in already dispatched, and with `call=` the activation peak of each component for that call) or one model's."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from torch import nn

import placement
from placement import estimate_call
from placement.transfers.inputs import measure_disk_read
from placement.activations import ActivationEstimateError
from placement.activations.fallback import EstimateFallback, weights_only_fallback
from placement.errors import DoesNotFitError
from placement.plan_schema import DEFAULT_DISK_SOURCE
from placement.sizing import dtype_for, dtype_label
from placement.unit_order import record_module_order

from ..errors import CallSpecError, FolderError, LoadError
from ..folder.components import PipelineComponents
from ..hf.calls import capture_call
from ..hf.calls.capture import RUN_KEYS, recorded_call
from ..hf.diffusers_pipeline import (
    capturable,
    graph_edges as diffusers_graph_edges,
    is_capturable,
    module_components as diffusers_module_components,
)
from .limits import check_call_limits
from .meta import layerwise_label
from .planning_progress import planning_progress
from .memory_techniques import (
    Outcome,
    PlannedCall,
    VaeOptions,
    activation_does_not_fit,
    attempt,
    batched,
    component_peak,
    technique_choices,
    vae_components,
    with_required_techniques,
)
from .request import DeviceMapKind, DeviceMapRequest, Scope, check_saved_plan, nest_flat_device_map
from .suggestions import Replanning, suggestions

# This library's three package folders: a frame whose file lies in one of them is not the user's.
_CONTEXTLIB = contextlib.__file__
_LIBRARY_DIRS = tuple(Path(__file__).resolve().parents[2] / name for name in ("placement", "hooks", "pipelines"))


def plan_pipeline(pipe, *, device_map, max_memory, torch_dtype, offload_folder, call, pinned: Mapping[str, Any],
                  modules: Mapping[str, nn.Module] | None = None, edges=None, gpu=None) -> placement.Plan:
    """`placement.plan` over the module components of a pipeline already built (a preset, a pipeline on meta);
    `device_map` may also be a saved plan or a flat `hf_device_map`."""
    if modules is None:
        modules, edges = modules_and_edges(pipe)
    return plan_modules(pipe, modules, edges=edges, device_map=DeviceMapRequest.interpret(device_map),
                        dtypes=torch_dtype, max_memory=max_memory, offload_folder=offload_folder, call=call,
                        pinned=pinned, gpu=gpu)


def plan_modules(pipe, modules: Mapping[str, nn.Module], *, edges, device_map: DeviceMapRequest, dtypes,
                 max_memory, offload_folder, call, pinned: Mapping[str, Any],
                 scope: Scope = Scope.PIPELINE, estimating=contextlib.nullcontext,
                 advise: Mapping[str, Any] | None = None, sizing_dtypes=None, gpu=None,
                 progress: bool = True) -> placement.Plan:
    """The plan of `modules` (of `pipe`, which describes its calls; None for one model): a saved plan checked and
    followed, anything else planned by one `placement.plan` call at `scope` (`prepare_plan`, `planning_call`,
    `finish_plan`); a pipeline load does the same in `pipeline_loader.plan_components`."""
    if device_map.kind is DeviceMapKind.SAVED_PLAN:
        return check_saved_plan(device_map.value, modules, dtypes)
    with planning_progress(enabled=progress):
        prepared = prepare_plan(pipe, modules, edges=edges, device_map=device_map, dtypes=dtypes,
                                max_memory=max_memory, offload_folder=offload_folder, call=call, pinned=pinned,
                                scope=scope, estimating=estimating, advise=advise, sizing_dtypes=sizing_dtypes, gpu=gpu)
        with planning_call(prepared):
            plan = placement.plan(modules, **prepared.arguments)
    return finish_plan(plan, prepared)


@dataclass(frozen=True, kw_only=True)
class PreparedPlan:
    """The one `placement.plan` call of a load, worked out before it is made: its keywords (`arguments`: the
    call's runs, activation peaks and work, the VAE techniques the planner may turn on, the formats' limits), and
    what finishing the plan, or explaining its failure, needs."""

    modules: Mapping[str, nn.Module]
    arguments: Mapping[str, Any]
    call: Mapping[str, Any] | None
    device_map: DeviceMapRequest
    advise: Mapping[str, Any] | None
    fallbacks: Sequence[EstimateFallback]
    planned: PlannedCall | None = None  # with call=: its runs, and how to estimate other technique sets
    options: VaeOptions = field(default_factory=VaeOptions)

    def replanning(self, activations: Mapping[str, int] | None) -> Replanning:
        """How suggestions re-plan: these arguments with `activations` fixed (no technique left to choose)."""
        return Replanning(modules=dict(self.modules), arguments={**self.arguments, "activations": activations,
                                                                 "techniques": None})


def prepare_plan(pipe, modules: Mapping[str, nn.Module], *, edges, device_map: DeviceMapRequest, dtypes, max_memory,
                 offload_folder, call, pinned: Mapping[str, Any], scope: Scope = Scope.PIPELINE,
                 estimating=contextlib.nullcontext, advise=None, sizing_dtypes=None, gpu=None,
                 format_limits: Mapping[str, placement.FormatLimit] | None = None) -> PreparedPlan:
    """The keywords of the one `placement.plan` call for `modules` (see `PreparedPlan`)."""
    strategy = device_map.value
    if device_map.kind is DeviceMapKind.PINS and scope is Scope.PIPELINE:
        strategy = nest_flat_device_map(strategy, modules)
    elif device_map.kind is DeviceMapKind.PINS:
        strategy = dict(strategy)  # a model's {submodule: device}, as accelerate takes it
    options, sizes = VaeOptions.split(call or {})
    if call is not None:
        check_call_limits(sizes, max_memory, pipe=pipe)  # an absurd call: refused before minutes of estimating
    module_order: dict[str, list[str]] = {}
    # A component whose call cannot be estimated is planned on its weights, said so, rather than refusing the call.
    with weights_only_fallback() as fallbacks:
        described = None if pipe is None else describe_call(pipe, modules, sizes if call is not None else None,
                                                            dtypes=dtypes, estimating=estimating)
        options = options if described is None else options.requiring(described.required)
        planned, activations = (None, None) if call is None else _planned_call(
            pipe, modules, sizes, options, described, dtypes=dtypes, estimating=estimating, module_order=module_order)
        work = {} if planned is None else work_arguments(described, modules, dtypes=dtypes, estimating=estimating)
    if planned is not None and fallbacks.records:  # no technique is planned on activations that are not counted
        planned = dataclasses.replace(planned, runs={name: runs for name, runs in planned.runs.items()
                                                     if name not in modules or not fallbacks.of(modules[name])})
    arguments = dict(max_memory=max_memory, strategy=strategy, graph=edges,
                     dtype=dtypes if sizing_dtypes is None else sizing_dtypes, offload_folder=offload_folder,
                     pinned=dict(pinned) or None, scope=scope.value, activations=activations,
                     runs_per_call=None if described is None else described.runs, gpu=gpu,
                     module_order=module_order or None, format_limits=format_limits or None,
                     techniques=None if planned is None else technique_choices(planned, activations, options), **work)
    return PreparedPlan(modules=modules, arguments=arguments, call=call, device_map=device_map, advise=advise,
                        fallbacks=tuple(fallbacks.records), planned=planned, options=options)


@contextlib.contextmanager
def planning_call(prepared: PreparedPlan):
    """Around the one `placement.plan` call: its warnings pointed at the user's line (from_pretrained(...)), not
    at our insides; a failure explained (`planning_failed`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except DoesNotFitError as error:
            failure = planning_failed(error, prepared)
            if failure is error:
                raise
            raise failure from error
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=caller_stacklevel())


def planning_failed(error: DoesNotFitError, prepared: PreparedPlan) -> Exception:
    """What a plan that fits nowhere raises: a component's format named (a LoadError, before anything is read);
    else the VAE's activations named when leaving them out would fit, with what would; with the single changes
    that would make it fit (`suggestions`). Only this path plans again: for those what-would-fit offers."""
    if getattr(error, "format_refused", None):
        return LoadError(str(error))
    planned, arguments = prepared.planned, prepared.arguments
    if planned is not None and arguments["activations"] is not None:
        plan_for = functools.partial(_plan_with, prepared.modules, {**arguments, "techniques": None})
        base = Outcome(error=error, activations=arguments["activations"])
        error = activation_does_not_fit(plan_for, planned, base, vae_components(planned.modules, planned.runs),
                                        prepared.options, attempt, batched)
    if prepared.advise and prepared.device_map.kind is DeviceMapKind.STRATEGY:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lines = suggestions(None, prepared.advise, prepared.replanning(arguments["activations"]))
        error.args = (" ".join([str(error), *lines]),)
    return error


def _plan_with(modules: Mapping[str, nn.Module], arguments: Mapping[str, Any],
               activations: Mapping[str, int] | None) -> placement.Plan:
    return placement.plan(modules, **{**arguments, "activations": activations})


def finish_plan(plan: placement.Plan, prepared: PreparedPlan) -> placement.Plan:
    """The plan with the call it was made for, the components whose activations are not counted, and the
    single changes that would do better (`plan.advise()`, worked out when asked)."""
    if prepared.planned is None and prepared.options.required:  # a VAE that runs only tiled: tiled without call=
        plan = with_required_techniques(plan, prepared.options)
    if prepared.call is not None:
        plan = with_estimate_fallbacks(plan.with_inputs(call=recorded_call(prepared.call)), prepared.modules,
                                       prepared.fallbacks)
    if prepared.advise and prepared.device_map.kind is DeviceMapKind.STRATEGY and plan.accelerators:
        given = prepared.arguments["activations"]
        chosen = None if given is None else {name: plan.components[name].activation_bytes for name in given
                                             if name in plan.components}
        plan = plan.with_advice(_advice(plan, prepared.advise, prepared.replanning(chosen)))
    return plan


def with_estimate_fallbacks(plan: placement.Plan, modules: Mapping[str, nn.Module],
                            records: Sequence[EstimateFallback]) -> placement.Plan:
    """The plan with each component whose call could not be estimated marked "activations not counted" (its
    verdict says what the plan therefore does not guarantee), and a warning naming it and why."""
    components = dict(plan.components)
    for name, module in modules.items():
        mine = [record for record in records if record.module() is module]
        if not mine or name not in components:
            continue
        why = "; ".join(record.explanation for record in mine)
        components[name] = components[name].model_copy(update={"activations_not_counted": why})
        warnings.warn(f"The plan counts {name}'s weights only, not its activations: {why}. It does not guarantee "
                      f"that {name}'s call fits; give its peak with placement.plan(activations={{'{name}': "
                      "<bytes>}) or leave room on its device.", UserWarning, stacklevel=caller_stacklevel())
    return plan.model_copy(update={"components": components})


def with_measured_disk_speed(plan: placement.Plan, metas: Mapping[str, Any]) -> placement.Plan:
    """`plan` with the measured read speed of the drive its disk-homed weights are served from, where it assumed one.
    The load calls this, not planning: the measurement reads up to 256 MiB, and a plan reads no weights."""
    if plan.disk_read_bandwidth_source != DEFAULT_DISK_SOURCE:
        return plan  # stated (a saved plan's given or measured speed): kept
    files = [file for name, component in plan.components.items() if component.placed_bytes.get("disk")
             and getattr(metas.get(name), "weights", None) is not None for file in metas[name].weights.files]
    if not files:
        return plan
    speed, source = measure_disk_read(files[0])
    return plan.model_copy(update={"disk_read_bandwidth": speed, "disk_read_bandwidth_source": source})


def _advice(plan: placement.Plan, metas: Mapping[str, Any], replanning: Replanning):
    """How `plan.advise()` works out its suggestions, when asked (they re-plan with each candidate storage)."""
    def advice() -> list[str]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return suggestions(plan, metas, replanning)
    return advice


def _planned_call(pipe, modules: Mapping[str, nn.Module], sizes: Mapping[str, Any], options: VaeOptions,
                  described: DescribedCall, *, dtypes, estimating,
                  module_order: dict[str, list[str]]) -> tuple[PlannedCall, dict[str, int]]:
    """The call's runs of each component and their activation peaks (with what `call=` forces on the VAEs)."""
    with estimating():
        activations = estimate_peaks(described, modules, torch_dtype=dtypes, module_order=module_order,
                                     techniques=options.forced_for(modules, described.calls))
    planned = PlannedCall(runs=described.calls, modules=modules, dtypes=dtypes, sizes=sizes, estimating=estimating,
                          describe=functools.partial(_smaller_call_runs, pipe, modules, dtypes, estimating))
    return planned, activations


def _smaller_call_runs(pipe, modules: Mapping[str, nn.Module], dtypes, estimating,
                       sizes: Mapping[str, Any]) -> Mapping[str, list]:
    return describe_call(pipe, modules, sizes, dtypes=dtypes, estimating=estimating).calls


def caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside this library (its three packages) and the context managers
    it runs in (`planning_call`), for warnings."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (_in_library(frame.f_code.co_filename) or frame.f_code.co_filename == _CONTEXTLIB):
        frame, level = frame.f_back, level + 1
    return level


@functools.lru_cache(maxsize=None)
def _in_library(filename: str) -> bool:
    return any(Path(filename).resolve().is_relative_to(directory) for directory in _LIBRARY_DIRS)


def call_activations(pipe: PipelineComponents, modules: Mapping[str, nn.Module], call: Mapping[str, Any], *,
                     torch_dtype=None, module_order: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Peak activation bytes per component for one call, with the VAE techniques `call` turns on; `module_order`,
    when a dict, receives each component's submodule paths in the order the call runs them."""
    options, sizes = VaeOptions.split(call)
    described = describe_call(pipe, modules, sizes, dtypes=torch_dtype)
    options = options.requiring(described.required)
    return estimate_peaks(described, modules, torch_dtype=torch_dtype, module_order=module_order,
                          techniques=options.forced_for(modules, described.calls))


@dataclass(frozen=True, kw_only=True)
class DescribedCall:
    """What one call of a pipeline runs: per component its example calls, its runs (None: unknown), and, when
    captured, its activation peak and submodule order (no technique on)."""

    calls: dict[str, list]
    runs: dict[str, int] | None
    peaks: Mapping[str, int] = field(default_factory=dict)
    module_order: Mapping[str, list[str]] = field(default_factory=dict)
    work: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # (FLOPs, bytes touched) per run, captured
    required: Mapping[str, Any] = field(default_factory=dict)  # VAE -> a technique it cannot run the call without


def describe_call(pipe, modules: Mapping[str, nn.Module], call: Mapping[str, Any] | None, *, dtypes=None,
                  estimating=contextlib.nullcontext) -> DescribedCall:
    """What `call` (None: the pipeline's defaults, for its runs only) runs of each component: said by the pipeline
    itself (`activation_inputs`, `runs_per_call`), or captured by running a diffusers pipeline's own `__call__`."""
    if hasattr(pipe, "activation_inputs") or hasattr(pipe, "runs_per_call") or not is_capturable(pipe):
        return _self_described(pipe, modules, call)
    try:
        # The capture passes each output to the next component: a fallback needs one (`weights_only_fallback`).
        with estimating(), weights_only_fallback(outputs_needed=True):
            captured = capture_call(capturable(pipe), modules, call,
                                    dtype_of=lambda name: dtype_for(dtypes, name))
    except (CallSpecError, ActivationEstimateError) as error:
        if call is not None:
            raise
        warnings.warn(f"Runs per call are not known, so the plan counts one run of each component: {error}",
                      UserWarning, stacklevel=caller_stacklevel())
        return DescribedCall(calls={}, runs=None)
    # A module the call never runs (AnimateDiff's motion_adapter, merged into its UNet) needs no activations.
    return DescribedCall(calls={name: captured.calls.get(name, []) for name in modules}, runs=captured.runs,
                         peaks={name: captured.peaks.get(name, 0) for name in modules},
                         module_order=captured.module_order, work=captured.work_per_run(),
                         required=captured.required)


def _self_described(pipe, modules: Mapping[str, nn.Module], call: Mapping[str, Any] | None) -> DescribedCall:
    runs = call_runs(pipe, modules, call)
    if call is None:
        return DescribedCall(calls={}, runs=runs)
    describe = getattr(pipe, "activation_inputs", None)
    if describe is None:
        raise CallSpecError(
            f"call= is not known for {pipeline_class_name(pipe)}: give its class an `activation_inputs(self, "
            "**call)` method returning {component: ExampleCall(args=..., kwargs=..., method=...)} with meta tensors "
            "of the shapes its __call__ passes, or plan without call= (weights only)."
        )
    sizes = {key: value for key, value in call.items() if key not in RUN_KEYS}  # runs, not sizes
    try:
        return DescribedCall(calls={name: [spec] for name, spec in describe(**sizes).items()}, runs=runs)
    except TypeError as error:
        raise CallSpecError(
            f"call={dict(call)!r} does not fit {type(pipe).__name__}.activation_inputs: {error}. "
            "Give e.g. {'height': 1024, 'width': 1024, 'batch_size': 1}."
        ) from error


def work_arguments(described: DescribedCall, modules: Mapping[str, nn.Module], *, dtypes=None,
                   estimating=contextlib.nullcontext) -> dict[str, dict[str, int]]:
    """`placement.plan`'s `flops_per_run` and `bytes_touched_per_run` for the call (0 for a component it never runs)."""
    flops, touched = {}, {}
    for name, examples in described.calls.items():
        if name not in modules:
            continue
        if name in described.work or not examples:
            flops[name], touched[name] = described.work.get(name, (0, 0))
            continue
        first = examples[0]
        if not all(hasattr(first, field) for field in ("args", "kwargs", "method")):
            continue  # an object with only `estimate(module, dtype)`: its FLOPs stay unknown (no time predicted)
        with estimating():
            estimate = estimate_call(modules[name], tuple(first.args), dict(first.kwargs), method=first.method,
                                     dtype=dtype_for(dtypes, name), keep_values=getattr(first, "keep_values", False))
        flops[name], touched[name] = estimate.flops, estimate.bytes_touched
    return {"flops_per_run": flops, "bytes_touched_per_run": touched}


def estimate_peaks(described: DescribedCall, modules: Mapping[str, nn.Module], *, torch_dtype=None,
                   module_order: dict[str, list[str]] | None = None,
                   techniques: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Each component's largest activation peak over its calls (with `techniques[name]` on, if any); the peaks the
    capture already estimated are used as they are where no technique is on."""
    peaks = {}
    for name, examples in described.calls.items():
        if name not in modules:
            continue
        used = (techniques or {}).get(name, ())
        if not examples:  # not run by this call
            peaks[name], order = described.peaks.get(name, 0), []
        elif not used and name in described.peaks:
            peaks[name], order = described.peaks[name], list(described.module_order.get(name, ()))
        else:
            with record_module_order(modules[name]) as order:
                peaks[name] = component_peak(name, modules[name], examples, dtype_for(torch_dtype, name), used)
        if module_order is not None:
            module_order[name] = order
    return peaks


def call_runs(pipe, modules: Mapping[str, nn.Module], call: Mapping[str, Any] | None) -> dict[str, int] | None:
    """How many times each component runs per call (`placement.plan(runs_per_call=)`) by the pipeline's own
    `runs_per_call(**call)`, with its defaults when `call` leaves them out (or is None); None when it has none."""
    call = dict(call or {})
    describe = getattr(pipe, "runs_per_call", None)
    if describe is None:
        given = [key for key in RUN_KEYS if key in call]
        if given:
            raise CallSpecError(
                f"call= gives {' and '.join(given)}, but {pipeline_class_name(pipe)} does not say which component "
                "runs at each step: give its class a `runs_per_call(self, num_inference_steps=..., **call)` method "
                "returning {component: runs}, or pass runs_per_call= to placement.plan."
            )
        return None
    try:
        runs = describe(**call)
    except TypeError as error:
        raise CallSpecError(f"call={call!r} does not fit {type(pipe).__name__}.runs_per_call: {error}.") from error
    return {name: count for name, count in runs.items() if name in modules}


def pipeline_class_name(pipe: PipelineComponents) -> str:
    """The pipeline class the folder names (a generic pipeline keeps model_index.json's `_class_name`)."""
    return getattr(pipe, "folder_class_name", None) or type(pipe).__name__


def passed_pins(passed: Mapping[str, Any], *, pin: Sequence[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """Components passed in that stay where they are, with their device maps, and the plan's notes about the
    others: pinned when their own map puts weights off the CPU (their owner placed them) or `pin` names them. A
    map keeping everything on the CPU (what diffusers leaves on `from_single_file` models) says nothing."""
    pins, notes = {}, []
    for name, obj in passed.items():
        if not isinstance(obj, nn.Module):
            continue
        device_map = getattr(obj, "hf_device_map", None)
        hooked = any(hasattr(submodule, "_hf_hook") for submodule in obj.modules())
        if device_map and (name in pin or _places_off_host(device_map)):
            pins[name] = dict(device_map)
        elif name in pin:
            pins[name] = {"": _weights_device(obj)}
        elif device_map and not hooked:
            notes.append(f"{name} was passed in with hf_device_map={dict(device_map)} (a default load, everything "
                         "on the CPU): placed like the other components (pin=[...] keeps it where it is).")
        elif hooked:
            raise FolderError(
                f"Component {name!r} was passed in with accelerate hooks but no hf_device_map placing weights on an "
                "accelerator, so where it runs is unknown; remove its hooks (accelerate.hooks.remove_hook_from_module"
                "(m, recurse=True)), load it with its own device_map, or pin it (pin=[...])."
            )
    return pins, notes


def _places_off_host(device_map: Mapping[str, Any]) -> bool:
    """Whether a map puts any weight on an accelerator or the disk (anything but the CPU)."""
    return any(str(device) != "cpu" for device in device_map.values())


def _weights_device(module: nn.Module):
    for tensor in module.parameters():
        return "cpu" if tensor.device.type == "cpu" else (tensor.device.index or 0)
    return "cpu"


def component_origin(meta) -> str:
    """Where a component's sized dtype comes from, for the plan's dtype label: the dtype's origin, and for a
    quantized or layerwise-cast one, that too."""
    origin = meta.dtype_origin
    quantization = meta.quantization
    if meta.owner is not None and meta.owner.single_file:
        origin = f"single file {meta.owner.source.name}"
    elif quantization is not None:
        origin = "pre-quantized folder" if quantization.pre_quantized else "quantization_config"
    if meta.layerwise_casting is not None:
        origin += f"; {layerwise_label(meta.layerwise_casting)}"  # Linear/Conv weights stored in it, upcast per layer
    return origin


def with_notes(plan: placement.Plan, notes: Sequence[str]) -> placement.Plan:
    """The plan with `notes` added to its warnings (each one line)."""
    if not notes:
        return plan
    return plan.model_copy(update={"warnings": [*plan.warnings, *notes]})


def modules_and_edges(pipe) -> tuple[dict[str, nn.Module], list[tuple[str, str]]]:
    """Module components in execution order and the model graph, of ours or of a diffusers pipeline."""
    if isinstance(pipe, PipelineComponents):
        return pipe.module_components, pipe.graph_edges
    modules = diffusers_module_components(pipe)
    return modules, diffusers_graph_edges(type(pipe), modules)


def label_dtypes(plan: placement.Plan, modules: Mapping[str, nn.Module], torch_dtype,
                 origins: Mapping[str, str]) -> placement.Plan:
    """The plan with each component's dtype stated with its origin, e.g. "bfloat16 (torch_dtype)",
    "float16 (checkpoint)", "float32 (config.json only: ...)"."""
    components = {
        name: component.model_copy(update={"dtype": dtype_label(
            modules[name], dtype_for(torch_dtype, name), origin=origins.get(name))})
        for name, component in plan.components.items()
    }
    return plan.model_copy(update={"components": components})

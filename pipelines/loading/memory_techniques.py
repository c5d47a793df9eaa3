"""VAE tiling and slicing, planned: what the planner may turn on for a VAE whose decode does not fit
(`technique_choices`, chosen inside the one `placement.plan` call, which records the choice), and the load
applies it; tiling changes the decoded values slightly, so it is turned on only when needed.
`call={"vae_tiling": False}` forbids a technique, `True` forces it. When nothing fits, the error says whether
the VAE's activation is what does not fit, and what would."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import nn

import placement
from placement.activations import ActivationEstimateError
from placement.errors import DoesNotFitError
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from placement.plan_schema import MemoryTechnique, PlannedTechnique
from placement.sizes import format_bytes
from placement.sizing import dtype_for

from ..errors import CallSpecError
from ..hf.calls.capture import TECHNIQUE_KEYS as CALL_TECHNIQUE_KEYS
from ..hf.calls.vae_techniques import (
    RequiredTechnique,
    WithTechniques,
    enable_techniques,
    is_on,
    supported_techniques,
    tile_description,
)


# How far a smaller call is looked for: sides and frames are halved at most this many times each.
_HALVINGS = 2
# Halved sides of at least twice this are rounded down to a multiple of it (every family's latent pixel step
# divides it: 8, 16, 32 or 64); smaller ones are halved as they are (a family that refuses the size is skipped).
_SIDE_STEP = 64


def activation_does_not_fit(plan_for: Callable, call, base, vaes: Mapping[str, tuple], options,
                            attempt: Callable, batched: Callable) -> Exception:
    """The error for a call no plan fits: `base.error` as it is unless leaving the VAEs' activations out makes
    a plan fit; then a DoesNotFitError naming the activations, not the weights, with offers (module doc)."""
    without = attempt(plan_for, {**base.activations, **{name: 0 for name in vaes}})
    if not vaes or without.plan is None:
        return base.error
    best = {name: frozenset(t for t in offered if options.allows(t) and (t is not MemoryTechnique.VAE_SLICING
                                                                          or batched(call.runs[name])))
            for name, offered in vaes.items()}
    lines = [_needs(name, call, best[name], without.plan.components[name].bytes, options) for name in vaes]
    offers = [*_allowed_techniques(plan_for, call, base, vaes, options, attempt),
              *_smaller_call(plan_for, call, base, best, attempt)]
    offers.append(_room_offer(call, best, without.plan))
    planner = str(base.error).strip().split(". ")[0].rstrip(".")
    return DoesNotFitError(
        f"The VAE's activations do not fit, not its weights: {'; '.join(lines)}. The plan fits with them left "
        f"out (the planner: {planner}). What would fit: {'; or '.join(offers)}."
    )


def _needs(name: str, call, techniques: frozenset, weights: int, options: VaeOptions) -> str:
    if name in options.required:  # it cannot decode whole: only its required technique's figure exists
        needed = options.required[name]
        return (f"{name} has {format_bytes(weights)} of weights and needs "
                f"{format_bytes(call.peak(name, {needed.technique}))} of activations for this call "
                f"({_call_text(call.sizes)}) with {needed.technique.value}, which it cannot run without "
                f"({needed.reason})")
    text = f"{name} has {format_bytes(weights)} of weights and needs {format_bytes(call.peak(name, ()))} of " \
           f"activations for this call ({_call_text(call.sizes)}) decoded whole"
    if MemoryTechnique.VAE_TILING in techniques:
        text += f", {format_bytes(call.peak(name, techniques))} tiled ({tile_description(call.modules[name])})"
    return text


def _allowed_techniques(plan_for, call, base, vaes, options, attempt) -> list[str]:
    """A technique `call=` forbade that would make the plan fit."""
    offers = []
    for technique in MemoryTechnique:
        if options.allows(technique):
            continue
        peaks = {name: call.peak(name, {technique}) for name, offered in vaes.items() if technique in offered}
        if peaks and attempt(plan_for, {**base.activations, **peaks}).plan is not None:
            needs = ", ".join(f"{name} {format_bytes(peak)}" for name, peak in peaks.items())
            offers.append(f"allow {technique.value} (call={{'{technique.value}': True}}; activations then {needs})")
    return offers


def _smaller_call(plan_for, call, base, best: Mapping[str, frozenset], attempt) -> list[str]:
    """The first smaller call (fewer frames, then smaller sides) whose plan fits."""
    for sizes in smaller_sizes(call.sizes):
        try:
            runs = call.describe(sizes)
        except CallSpecError:
            continue
        peaks = {name: call.peak(name, best[name], runs) for name in best if name in runs}
        if attempt(plan_for, {**base.activations, **peaks}).plan is not None:
            needs = ", ".join(f"{name} {format_bytes(peak)}" for name, peak in peaks.items())
            return [f"a smaller call, {_call_text(sizes)} (activations then {needs})"]
    return []


def smaller_sizes(sizes: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Calls to try, smallest change first: frames halved (kept of the form k * 8 + 1, which every video
    family takes), then height and width halved (see `_SIDE_STEP`)."""
    found, current = [], dict(sizes)
    frames = sizes.get("num_frames")
    for _ in range(_HALVINGS if isinstance(frames, int) and frames > 9 else 0):
        current = {**current, "num_frames": max(1, (current["num_frames"] - 1) // 2 // 8 * 8 + 1)}
        found.append(current)
    current = dict(sizes)
    for _ in range(_HALVINGS):
        sides = {key: _halved(current[key]) for key in ("height", "width") if isinstance(current.get(key), int)}
        if not sides or any(value < 1 for value in sides.values()):
            break
        current = {**current, **sides}
        found.append(current)
    return found


def _halved(side: int) -> int:
    half = side // 2
    return half // _SIDE_STEP * _SIDE_STEP if half >= 2 * _SIDE_STEP else half


def _room_offer(call, best, plan) -> str:
    needs = {name: plan.components[name].bytes + call.peak(name, best[name]) + ACCELERATOR_RUNTIME_OVERHEAD
             for name in best}
    return ", ".join(f"an accelerator with {format_bytes(room)} for {name} alone (its weights, its activations"
                     f"{' with ' + ' and '.join(t.value for t in best[name]) if best[name] else ''} and the "
                     f"{format_bytes(ACCELERATOR_RUNTIME_OVERHEAD)} runtime overhead)" for name, room in needs.items())


def _call_text(sizes: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sizes.items() if key in ("height", "width", "num_frames",
                                                                                   "batch_size",
                                                                                   "num_images_per_prompt"))


TECHNIQUE_KEYS = {key: MemoryTechnique(key) for key in CALL_TECHNIQUE_KEYS}  # "vae_tiling" -> VAE_TILING, ...
_VAE_METHODS = ("decode", "encode")


@dataclass(frozen=True, kw_only=True)
class VaeOptions:
    """What `call=` says of each technique: True forces it, False forbids it, None lets the plan decide."""

    wanted: Mapping[MemoryTechnique, bool | None] = field(default_factory=dict)
    # {VAE: a technique its own code cannot run the call without} (call capture's `RequiredTechnique`): forced.
    required: Mapping[str, RequiredTechnique] = field(default_factory=dict)

    @classmethod
    def split(cls, call: Mapping[str, Any]) -> tuple["VaeOptions", dict[str, Any]]:
        """The technique options of `call`, and the rest of it (the call's sizes)."""
        wanted = {}
        for key, technique in TECHNIQUE_KEYS.items():
            value = call.get(key)
            if value is not None and not isinstance(value, bool):
                raise CallSpecError(f"call= {key} must be True, False or None (let the plan decide), got {value!r}.")
            wanted[technique] = value
        return cls(wanted=wanted), {key: value for key, value in call.items() if key not in TECHNIQUE_KEYS}

    def requiring(self, required: Mapping[str, RequiredTechnique]) -> "VaeOptions":
        """These options with the techniques the call's VAEs cannot run without; `call=` forbidding one of
        them is an error that says why."""
        for name, needed in required.items():
            if self.wanted.get(needed.technique) is False:
                raise CallSpecError(
                    f"call= forbids {needed.technique.value} ({needed.technique.value}=False), but {name} cannot "
                    f"run this call without it ({needed.reason}; diffusers' own pipeline needs it on too). Leave "
                    f"{needed.technique.value} out of call= or set it True.")
        return dataclasses.replace(self, required={**self.required, **required})

    def allows(self, technique: MemoryTechnique) -> bool:
        return self.wanted.get(technique) is not False

    def forced_for(self, modules: Mapping[str, nn.Module], runs: Mapping[str, list]) -> dict[str, frozenset]:
        """{VAE: the techniques `call=` forces, and those a component passed in has on already}; a technique
        `call=` forces that no VAE of the pipeline offers is an error."""
        forced = {technique for technique, value in self.wanted.items() if value}
        vaes = vae_components(modules, runs)
        for technique in forced:
            if not any(technique in offered for offered in vaes.values()):
                key = next(key for key, value in TECHNIQUE_KEYS.items() if value is technique)
                found = ", ".join(f"{name} ({type(module).__name__})" for name, module in modules.items()) or "none"
                raise CallSpecError(f"call= asks for {key}=True, but no component this call decodes with offers "
                                    f"it (components: {found}); leave {key} out.")
        return {name: frozenset(t for t in offered if t in forced or (is_on(modules[name], t) and self.allows(t))
                                or self._required(name, t))
                for name, offered in vaes.items()}

    def _required(self, name: str, technique: MemoryTechnique) -> bool:
        return name in self.required and self.required[name].technique is technique


def vae_components(modules: Mapping[str, nn.Module], runs: Mapping[str, list]) -> dict[str, tuple]:
    """{component: techniques it offers} for each component the call encodes or decodes with."""
    found = {}
    for name, examples in runs.items():
        module = modules.get(name)
        if isinstance(module, nn.Module) and any(example.method in _VAE_METHODS for example in examples):
            offered = supported_techniques(module)
            if offered:
                found[name] = offered
    return found


def component_peak(name: str, module: nn.Module, examples, dtype, techniques=()) -> int:
    """The largest activation peak of `module`'s calls, with `techniques` on; a failure names the component."""
    try:
        return max(WithTechniques(call=example, techniques=frozenset(techniques)).estimate(module, dtype=dtype)
                   for example in examples)
    except ActivationEstimateError as error:
        raise error.for_component(name) from error


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One planning attempt (for what-would-fit offers): its plan or the fitting error, its warnings, the
    activations it used."""

    plan: placement.Plan | None = None
    error: Exception | None = None
    warnings: tuple = ()
    activations: Mapping[str, int] | None = None


def attempt(plan_for: Callable, activations: Mapping[str, int] | None) -> Outcome:
    """`plan_for(activations)`, its warnings caught (the caller re-emits those of the plan it keeps)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = plan_for(activations)
        except DoesNotFitError as error:
            return Outcome(error=error, warnings=tuple(caught), activations=activations)
    return Outcome(plan=plan, warnings=tuple(caught), activations=activations)


@dataclass(frozen=True, kw_only=True)
class PlannedCall:
    """The call being planned, and how to describe a smaller one (for what-would-fit offers)."""

    runs: Mapping[str, list]
    modules: Mapping[str, nn.Module]
    dtypes: Any
    sizes: Mapping[str, Any]
    describe: Callable[[Mapping[str, Any]], Mapping[str, list]]
    estimating: Callable[[], Any] = contextlib.nullcontext  # the context estimates run in (layerwise casting)
    known: dict = field(default_factory=dict, compare=False, repr=False)  # (name, techniques) -> this call's peak

    def peak(self, name: str, techniques, runs: Mapping[str, list] | None = None) -> int:
        """`name`'s activation peak with `techniques` on, for this call (or for `runs`, a smaller one)."""
        key = (name, frozenset(techniques))
        if runs is None and key in self.known:
            return self.known[key]
        with self.estimating():
            peak = component_peak(name, self.modules[name], (runs or self.runs)[name],
                                  dtype_for(self.dtypes, name), techniques)
        if runs is None:
            self.known[key] = peak
        return peak


def technique_choices(call: PlannedCall, activations: Mapping[str, int],
                      options: VaeOptions) -> placement.TechniqueChoices | None:
    """What the planner may turn on for the VAEs of `call` (`placement.TechniqueChoices`): the technique sets to
    try when the plan does not fit, in order of preference (`_candidates`), each VAE's peak under them, what
    `call=` forces (on in `activations` already) and why; None when no component of the call offers any."""
    forced = options.forced_for(call.modules, call.runs)
    vaes = vae_components(call.modules, call.runs)
    if not vaes:
        return None
    for name, techniques in forced.items():
        call.known[(name, techniques)] = activations[name]  # estimated so by the caller
    return placement.TechniqueChoices(
        candidates=_candidates(options, vaes, call.runs, forced), peak=call.peak, forced=forced,
        forced_reasons={name: {technique: _forced_reason(technique, options, name) for technique in techniques}
                        for name, techniques in forced.items()},
        details={name: {MemoryTechnique.VAE_TILING: tile_description(call.modules[name])} for name in vaes})


def _forced_reason(technique: MemoryTechnique, options: VaeOptions, name: str) -> str:
    key = next(key for key, value in TECHNIQUE_KEYS.items() if value is technique)
    return f"asked for in call= ({key}=True)" if options.wanted.get(technique) else \
        f"required: {options.required[name].reason}" if options._required(name, technique) else \
        "on already in the component given (it stays on)"


def with_required_techniques(plan: placement.Plan, options: VaeOptions) -> placement.Plan:
    """A plan made without `call=` with the techniques its VAEs cannot run without recorded (the load turns them
    on, as diffusers' users do by hand), each with why. With `call=` the planner records them as forced
    (`technique_choices`)."""
    components = dict(plan.components)
    for name, needed in options.required.items():
        if name in components:
            record = PlannedTechnique(technique=needed.technique, activation_bytes_without=None,
                                      reason=f"{_forced_reason(needed.technique, options, name)}.")
            components[name] = components[name].model_copy(update={"memory_techniques": [record]})
    return plan.model_copy(update={"components": components})


def _candidates(options: VaeOptions, vaes: Mapping[str, tuple], runs, forced) -> list[dict[str, frozenset]]:
    """Technique sets to try, in order of preference: sliced (no change in the output; a batch only), tiled,
    both; each with what `call=` forces, none with what it forbids."""
    tiling, slicing = MemoryTechnique.VAE_TILING, MemoryTechnique.VAE_SLICING
    wanted = [{slicing}, {tiling}, {slicing, tiling}]
    candidates = []
    for extra in wanted:
        techniques = {}
        for name, offered in vaes.items():
            usable = {t for t in extra if t in offered and options.allows(t)}
            if slicing in usable and not batched(runs[name]):
                usable.discard(slicing)  # one sample: slicing saves nothing
            techniques[name] = frozenset(usable | forced.get(name, frozenset()))
        if techniques != dict(forced) and techniques not in candidates:
            candidates.append(techniques)
    return candidates


def batched(examples) -> bool:
    """Whether a VAE call decodes (or encodes) more than one sample at once."""
    for example in examples:
        args = getattr(getattr(example, "call", example), "args", ())
        if args and getattr(args[0], "shape", (1,))[0] > 1:
            return True
    return False


def apply_memory_techniques(pipe: Any, plan: placement.Plan) -> dict[str, tuple[str, ...]]:
    """Turn on in each module the techniques the plan chose; {component: the methods that undo it} for a reset."""
    components, undo = getattr(pipe, "components", {}), {}
    for name, component in plan.components.items():
        if component.memory_techniques and isinstance(components.get(name), nn.Module):
            undo[name] = enable_techniques(components[name], [used.technique for used in component.memory_techniques])
    return undo

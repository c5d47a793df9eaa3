"""What the caller lets the planner choose, or forbids, for a component: memory techniques that shrink its
activations (VAE tiling/slicing: `TechniqueChoices`, chosen by `choose_techniques` inside the one `plan()` call)
and placements its weight format cannot run in (`FormatLimit`, which the search never proposes).

The caller (the loader) knows the techniques and formats: their peaks, tile sizes, what `call=` forces or forbids,
what a quantized tensor survives. The planner owns the choice: the plan with no technique first; when it does not
fit, each technique set in the caller's order of preference, the best outcome winning (a plan before none, then the
verdict, then the weight bytes kept off the accelerators; ties to the earlier), recorded on the component with why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from .devices import device_label
from .errors import DoesNotFitError
from .plan_schema import MemoryTechnique, PlacementKind, Plan, PlannedTechnique, VerdictKind
from .sizes import format_bytes

_OFF_ACCELERATORS = (PlacementKind.OFFLOADED, PlacementKind.DISK, PlacementKind.CPU)
_WORDS = {MemoryTechnique.VAE_TILING: "tiled", MemoryTechnique.VAE_SLICING: "sliced"}
_BEST = (0, list(VerdictKind).index(VerdictKind.FITS), 0)  # a plan that fits, every weight on the accelerators


@dataclass(frozen=True, kw_only=True)
class FormatLimit:
    """Placements a component's weight format cannot run in: `refused[kind]` says why (OFFLOADED: its weights
    cannot be homed in host RAM and streamed; DISK: not served from disk), `advice[kind]` what to do instead."""

    label: str  # the format in words, e.g. "nf4 (bitsandbytes)"
    refused: Mapping[PlacementKind, str]
    advice: Mapping[PlacementKind, str] = field(default_factory=dict)

    def refuses(self, kind: PlacementKind) -> bool:
        return kind in self.refused

    def error(self, name: str, size: int, kind: PlacementKind, why: str) -> DoesNotFitError:
        """The error when `name` can be placed nowhere but as `kind`, which its format cannot run."""
        where = "offloaded" if kind is PlacementKind.OFFLOADED else "on disk"
        error = DoesNotFitError(
            f"Component {name!r} ({self.label}, {format_bytes(size)}) would have to be {where}, which its format "
            f"cannot do here: {self.refused[kind]}. {why} {self.advice.get(kind, '')}".strip())
        error.format_refused = name  # the loader reports it as a load error naming the format
        return error


@dataclass(frozen=True, kw_only=True)
class TechniqueChoices:
    """The memory techniques the planner may turn on, per component: `candidates`, joint technique sets to try in
    order of preference when the plan without them does not fit (each with what is `forced`); `forced`, the sets on
    in the activations given already, with `forced_reasons[technique]`, why; `peak(name, techniques)`, the
    component's activation peak with them on (estimated when first tried); `details[name]`, what a technique does
    to it in words (e.g. "tiles of 16x16 pixels")."""

    candidates: Sequence[Mapping[str, frozenset]]
    peak: Callable[[str, frozenset], int]
    forced: Mapping[str, frozenset] = field(default_factory=dict)
    forced_reasons: Mapping[str, Mapping[MemoryTechnique, str]] = field(default_factory=dict)
    details: Mapping[str, Mapping[MemoryTechnique, str]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class _Outcome:
    plan: Optional[Plan] = None
    error: Optional[DoesNotFitError] = None
    warnings: tuple = ()
    activations: Mapping[str, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        """Smaller is better: a plan before none, then the verdict, then the weight bytes off the accelerators."""
        if self.plan is None:
            return (1,)
        off = sum(c.bytes for c in self.plan.components.values() if c.kind in _OFF_ACCELERATORS)
        return (0, list(VerdictKind).index(self.plan.verdict.kind), off)


def choose_techniques(search: Callable[[Mapping[str, int]], Plan], activations: Mapping[str, int],
                      choices: Optional[TechniqueChoices]) -> Plan:
    """`search(activations)`; when its plan does not fit and `choices` offers techniques, the best of the technique
    sets (module doc), recorded on the components. Only the kept search's warnings are shown."""
    base = _attempt(search, activations)
    best, chosen = base, dict(choices.forced) if choices else {}
    if choices is not None and (base.plan is None or base.plan.verdict.kind is not VerdictKind.FITS):
        for techniques in choices.candidates:
            trial = _attempt(search, {**activations, **{name: choices.peak(name, used)
                                                         for name, used in techniques.items()}})
            if trial.key < best.key:
                best, chosen = trial, dict(techniques)
            if best.key == _BEST:  # nothing later can do better: spare its estimate
                break
    for warning in best.warnings:
        warnings.warn(warning.message, warning.category, stacklevel=3)
    if best.plan is None:
        raise base.error
    return best.plan if choices is None else _recorded(best.plan, chosen, base, choices)


def _attempt(search: Callable[[Mapping[str, int]], Plan], activations: Mapping[str, int]) -> _Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = search(activations)
        except DoesNotFitError as error:
            return _Outcome(error=error, warnings=tuple(caught), activations=activations)
    return _Outcome(plan=plan, warnings=tuple(caught), activations=activations)


def _recorded(plan: Plan, chosen: Mapping[str, frozenset], base: _Outcome, choices: TechniqueChoices) -> Plan:
    """The plan with each component's techniques recorded (the load applies them) and why."""
    components = dict(plan.components)
    for name, techniques in chosen.items():
        if not techniques or name not in components:
            continue
        component = components[name]
        without = base.activations.get(name)
        forced = choices.forced.get(name, frozenset())
        records = [PlannedTechnique(technique=technique,
                                    activation_bytes_without=None if technique in forced else without,
                                    reason=_reason(name, technique, component.activation_bytes, without, base,
                                                   choices))
                   for technique in sorted(techniques, key=list(MemoryTechnique).index)]
        components[name] = component.model_copy(update={"memory_techniques": records})
    return plan.model_copy(update={"components": components})


def _reason(name: str, technique: MemoryTechnique, activation: Optional[int], without: Optional[int],
            base: _Outcome, choices: TechniqueChoices) -> str:
    if technique in choices.forced.get(name, frozenset()):
        why = choices.forced_reasons.get(name, {}).get(technique, "asked for")
        return f"{why}; its activations for this call are {_bytes(activation)}."
    detail = choices.details.get(name, {}).get(technique)
    detail = f" ({detail})" if detail else ""
    return (f"for this call its activations are {_bytes(without)} decoded whole and "
            f"{_bytes(activation)} {_WORDS[technique]}{detail}; decoded whole, "
            f"{_outcome_words(base)}. Forbid it with call={{'{technique.value}': False}}.")


def _bytes(value: Optional[int]) -> str:
    return "unknown" if value is None else format_bytes(value)


def _outcome_words(outcome: _Outcome) -> str:
    if outcome.plan is None:
        return f"no plan fits ({_first_sentence(outcome.error)})"
    moved = [f"{c.name} {'on the CPU' if c.execution_device == 'cpu' else c.kind.value}"
             for c in outcome.plan.components.values() if c.kind in _OFF_ACCELERATORS]
    return f"the plan {outcome.plan.verdict.kind.value}" + (f" ({', '.join(moved)})" if moved else "")


def _first_sentence(error: Optional[Exception]) -> str:
    text = str(error or "").strip()
    end = text.find(". ")
    return text[: end if end > 0 else None].rstrip(".")


def kept_whole_notes(by_name: Mapping, requests: Mapping) -> list[str]:
    """"text_encoder (nf4 (bitsandbytes)) kept whole on GPU 0: ...": for each component whose format limit kept it
    from where other components went (offloaded, on disk), one line; `by_name` holds each component's `Placed`."""
    notes = []
    for name, request in requests.items():
        limit, placed = request.limit, by_name.get(name)
        if limit is None or placed is None:
            continue
        plan = placed.plan
        for kind in limit.refused:
            moved = (kind, PlacementKind.DISK)  # offloading refused: the disk is the same way out
            others = [other for other, found in by_name.items() if other != name and found.plan.kind in moved]
            if plan.kind is kind or not others:
                continue
            words = "be offloaded" if kind is PlacementKind.OFFLOADED else "be served from disk"
            notes.append(f"{name} ({limit.label}) kept {_where(plan)}: its format cannot {words}, so the other "
                         "components were planned around it.")
            break
    return notes


def _where(plan) -> str:
    labels = [device_label(device) for device in plan.devices]
    if plan.kind is PlacementKind.WHOLE:
        return f"whole on {labels[0]}"
    if plan.kind is PlacementKind.SPLIT:
        return f"split over {', '.join(labels)}"
    return f"in {' and '.join(labels)}"

"""When no plan fits even with the VAE techniques `call=` allows: if the VAEs' activations are what does not fit
(the same plan fits with them left out), an error that says so, with the numbers, and what would fit: a
technique `call=` forbade, a smaller call (the VAE re-estimated; the other components keep this call's
activations, so the offer errs on the safe side), or the room one accelerator would need."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from placement.errors import DoesNotFitError
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD
from placement.plan_schema import MemoryTechnique
from placement.sizes import format_bytes

from ..errors import CallSpecError
from ..hf.calls.vae_techniques import tile_description

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
    lines = [_needs(name, call, best[name], without.plan.components[name].bytes) for name in vaes]
    offers = [*_allowed_techniques(plan_for, call, base, vaes, options, attempt),
              *_smaller_call(plan_for, call, base, best, attempt)]
    offers.append(_room_offer(call, best, without.plan))
    planner = str(base.error).strip().split(". ")[0].rstrip(".")
    return DoesNotFitError(
        f"The VAE's activations do not fit, not its weights: {'; '.join(lines)}. The plan fits with them left "
        f"out (the planner: {planner}). What would fit: {'; or '.join(offers)}."
    )


def _needs(name: str, call, techniques: frozenset, weights: int) -> str:
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

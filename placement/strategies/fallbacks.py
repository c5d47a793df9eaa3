"""The chain every strategy shares: whole on an accelerator, else split along its blocks, else offloaded (CPU
RAM, streamed to the accelerator with the most room for its working set), else cpu, else disk. Each step past
the first is a Fallback whose reason gives the numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..devices import Device, device_label
from ..errors import DoesNotFitError
from ..memory_model import Ledger
from ..plan_schema import Fallback, PlacementKind
from ..sizes import format_bytes
from ..splitting import split_device_map
from .state import ComponentRequest, Context, Placed, component_plan


def place_with_fallbacks(request: ComponentRequest, ledger: Ledger, context: Context, order: Sequence[int]) -> Placed:
    """Whole on the first accelerator of `order` with room, else the fallback chain (a split fills them in `order`)."""
    for device in order:
        if ledger.fits(device, weights=request.bytes, transient=request.transient):
            return place_whole(request, ledger, device)
    why = f"{request.needs()}; {rooms_text(ledger, request)}."
    split = try_split(request, ledger, order, why, context)
    if split is None and request.refuses(PlacementKind.OFFLOADED):  # its format keeps it on the accelerators
        raise request.refusal(PlacementKind.OFFLOADED, f"{why} No split fits either.")
    return split or try_offload(request, ledger, why) or place_on_host(request, ledger, context, why)


def place_whole(request: ComponentRequest, ledger: Ledger, device: Device) -> Placed:
    ledger.add(device, weights=request.bytes, transient=request.transient, phase=request.name)
    kind = PlacementKind.CPU if device == "cpu" else PlacementKind.WHOLE
    return Placed(plan=component_plan(request, kind=kind, device_map={"": device}, execution_device=device,
                                      placed_bytes={device: request.bytes}))


def try_split(request: ComponentRequest, ledger: Ledger, order: Sequence[int], why: str,
              context: Context) -> Optional[Placed]:
    rooms = {device: ledger.room(device, transient=request.transient) for device in order}
    rooms = {device: room for device, room in rooms.items() if room is not None and room > 0}
    if len(rooms) < 2:
        return None
    key = (request.name, tuple(rooms.items()))  # the order of the rooms matters: the split fills them in turn
    if key not in context.split_cache:
        # Pieces balanced against the devices' whole budgets (issue 21: no GPU 0 at 98% beside a half-empty GPU 1).
        budgets = {device: ledger.loads[device].budget for device in rooms}
        balance = budgets if all(b is not None for b in budgets.values()) else None
        context.split_cache[key] = split_device_map(request.module, rooms, size=request.size, dtype=request.dtype,
                                                    balance=balance)
    device_map = context.split_cache[key]
    if device_map is None:
        return None
    placed: dict[Device, int] = {}
    for path, device in device_map.items():
        placed[device] = placed.get(device, 0) + request.size.module_sizes.get(path, 0)  # tensor-less modules: 0
    for device, weights in placed.items():
        ledger.add(device, weights=weights, transient=request.transient, phase=request.name)
    execution_device = next(iter(device_map.values()))
    plan = component_plan(
        request, kind=PlacementKind.SPLIT, device_map=device_map, execution_device=execution_device,
        placed_bytes=placed,
    )
    parts = ", ".join(f"{device_label(d)} {format_bytes(n)}" for d, n in plan.placed_bytes.items())
    reason = f"{why} Split along its blocks: {parts}."
    return Placed(plan=plan, fallback=Fallback(component=request.name, kind=PlacementKind.SPLIT, reason=reason))


def try_offload(request: ComponentRequest, ledger: Ledger, why: str) -> Optional[Placed]:
    """Weights in CPU RAM, streamed block by block to the accelerator with the most room for that."""
    stream = streaming_device(request, ledger, ledger.accelerators)
    if stream is None or not ledger.fits("cpu", weights=request.bytes):
        return None
    reason = f"{why} No split fits either. {streamed_text('cpu', stream, request.streamed)}"
    return place_streamed(request, ledger, host="cpu", execution_device=stream, reason=reason)


def place_on_host(request: ComponentRequest, ledger: Ledger, context: Context, why: str) -> Placed:
    """CPU RAM and run on the CPU when no accelerator can stream it, else disk; an error if neither fits."""
    if ledger.fits("cpu", weights=request.bytes, transient=request.transient):
        placed = place_whole(request, ledger, "cpu")
        no_stream = "" if not ledger.accelerators else (
            f" No accelerator has room for its streaming working set ({format_bytes(request.streamed)}: what offloading "
            "keeps on the device at once) next to its activations, so it runs on the CPU."
        )
        reason = f"{why}{no_stream}"
        fallback = Fallback(component=request.name, kind=PlacementKind.CPU, reason=reason)
        return Placed(plan=placed.plan, fallback=fallback)
    cpu_room = ledger.room("cpu", transient=request.transient)
    if request.refuses(PlacementKind.DISK) or request.refuses(PlacementKind.OFFLOADED):
        cpu_left = f" The CPU has {format_bytes(max(cpu_room or 0, 0))} left."
        raise request.refusal(PlacementKind.DISK if request.refuses(PlacementKind.DISK) else PlacementKind.OFFLOADED,
                              f"{why}{cpu_left}")
    if not context.has_offload_folder:
        cpu_left = f" The CPU has {format_bytes(max(cpu_room or 0, 0))} left." if ledger.accelerators else ""
        error = DoesNotFitError(
            f"{why}{cpu_left} Its weights must go to disk, and no offload_folder was given. "
            "Pass offload_folder=..., a larger max_memory, or more devices."
        )
        error.problem = f"{why}{cpu_left}"  # the facts without the fixes: a caller may order them (the CLI)
        raise error
    if not ledger.fits("disk", weights=request.bytes):
        raise DoesNotFitError(
            f"{why} Not even the disk budget has room ({format_bytes(max(ledger.room('disk') or 0, 0))} left). "
            "Raise max_memory['disk'] or free some space."
        )
    stream = streaming_device(request, ledger, ledger.accelerators)
    if stream is None and not ledger.fits("cpu", weights=0, transient=request.transient + request.streamed):
        raise DoesNotFitError(
            f"{why} Its weights could go to disk, but no device has room to run it: it needs "
            f"{format_bytes(request.streamed)} for its streaming working set next to its activations."
        )
    execution_device = stream if stream is not None else "cpu"
    reason = f"{why} No split fits either. {streamed_text('disk', execution_device, request.streamed)}"
    return place_streamed(request, ledger, host="disk", execution_device=execution_device, reason=reason)


def streaming_device(request: ComponentRequest, ledger: Ledger, candidates: Sequence[int]) -> Optional[int]:
    """The accelerator with the most room left once it holds the streaming working set and the activations."""
    transient = request.transient + request.streamed
    fitting = [d for d in candidates if ledger.fits(d, weights=0, transient=transient)]
    if not fitting:
        return None
    return max(fitting, key=lambda d: (ledger.room(d, transient=transient), -fitting.index(d)))


def place_streamed(request: ComponentRequest, ledger: Ledger, *, host: str, execution_device: Device,
                   reason: str) -> Placed:
    """Weights on `host` ("cpu" RAM or "disk"), streamed to `execution_device` when the component runs."""
    unit = request.streamed
    ledger.add(host, weights=request.bytes)
    ledger.add(execution_device, transient=request.transient + unit, phase=request.name)
    kind = PlacementKind.OFFLOADED if host == "cpu" else PlacementKind.DISK
    plan = component_plan(
        request, kind=kind, device_map={"": host}, execution_device=execution_device,
        placed_bytes={host: request.bytes}, streamed_unit_bytes=unit,
    )
    return Placed(plan=plan, fallback=Fallback(component=request.name, kind=kind, reason=reason))


def streamed_text(host: str, execution_device: Device, unit: int) -> str:
    where = "CPU RAM" if host == "cpu" else "on disk (served from the checkpoint files, or the offload folder)"
    return (
        f"Weights {'in ' if host == 'cpu' else ''}{where}, streamed to {device_label(execution_device)} block by block "
        f"({format_bytes(unit)} on the device at once)."
    )


def rooms_text(ledger: Ledger, request: ComponentRequest) -> str:
    """"GPU 0 has 2.00 GiB left, GPU 1 has 1.00 GiB left (0 B for weights after the 1.00 GiB runtime overhead)":
    "left" as in explain()'s table; the room for weights is less when activations or a first overhead must fit."""
    parts = []
    for device in ledger.accelerators:
        left = ledger.loads[device].budget - ledger.peak(device)
        room = max(ledger.room(device, transient=request.transient), 0)
        text = f"{device_label(device)} has {format_bytes(max(left, 0))} left"
        if room < max(left, 0):
            extra = [] if ledger.loads[device].used or not ledger.overhead(device) else [
                f"the {format_bytes(ledger.overhead(device))} runtime overhead"]
            if request.transient > ledger.loads[device].transient:
                extra.insert(0, "its activations")
            text += f" ({format_bytes(room)} for weights after {' and '.join(extra) or 'its activations'})"
        parts.append(text)
    return ", ".join(parts) if parts else "there is no accelerator"

"""The transfer meter: bytes our hooks move between the host and the accelerators, while it is on.

    with hooks.measure_transfers() as meter:
        pipe(...)
    meter.host_to_accelerator_bytes, meter.weights.host_to_accelerator_bytes, meter.inputs

Counted where the hooks move things, by *places* (accelerator index, "cpu", "disk": the disk counts as host), so
a copy to a virtual accelerator counts as on a GPU. Under non-strict virtual accelerators every tensor is a CPU
tensor, so the meter tracks logical places: tags on tensors returned to an accelerator caller, and a stack of the
running components' places.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

import torch

from placement.devices import Device, is_accelerator, strict_virtual_accelerators, virtual_accelerator_count
from placement.sizing import storage_bytes


class Payload(str, Enum):
    WEIGHTS = "weights"
    INPUTS = "inputs"  # tensors moved at component/device boundaries: inputs in, outputs back to the caller


class Direction(str, Enum):
    HOST_TO_ACCELERATOR = "host_to_accelerator"
    ACCELERATOR_TO_ACCELERATOR = "accelerator_to_accelerator"
    ACCELERATOR_TO_HOST = "accelerator_to_host"


@dataclass(frozen=True, kw_only=True)
class Traffic:
    host_to_accelerator_bytes: int = 0
    accelerator_to_accelerator_bytes: int = 0
    accelerator_to_host_bytes: int = 0


class TransferMeter:
    def __init__(self) -> None:
        self._bytes: Counter[tuple[Payload, Direction]] = Counter()
        self._onto: Counter[tuple[Payload, Direction, Device]] = Counter()  # by the accelerator copied onto

    def add(self, payload: Payload, direction: Direction, num_bytes: int, *, target: Device | None = None) -> None:
        self._bytes[(payload, direction)] += num_bytes
        if target is not None and is_accelerator(target):
            self._onto[(payload, direction, target)] += num_bytes

    def onto(self, payload: Payload, direction: Direction = Direction.HOST_TO_ACCELERATOR) -> dict[Device, int]:
        """Bytes of `payload` copied onto each accelerator in `direction`: with several GPUs each has its own link
        (`meter.onto(Payload.WEIGHTS)`: what each GPU's link carried from the host)."""
        return {target: n for (kind, moved, target), n in sorted(self._onto.items(), key=str)
                if kind is payload and moved is direction}

    def traffic(self, *payloads: Payload) -> Traffic:
        return Traffic(**{f"{direction.value}_bytes": sum(self._bytes[(payload, direction)] for payload in payloads)
                          for direction in Direction})

    @property
    def weights(self) -> Traffic:
        return self.traffic(Payload.WEIGHTS)

    @property
    def inputs(self) -> Traffic:
        return self.traffic(Payload.INPUTS)

    @property
    def host_to_accelerator_bytes(self) -> int:
        return self.traffic(*Payload).host_to_accelerator_bytes

    @property
    def accelerator_to_accelerator_bytes(self) -> int:
        return self.traffic(*Payload).accelerator_to_accelerator_bytes

    @property
    def accelerator_to_host_bytes(self) -> int:
        return self.traffic(*Payload).accelerator_to_host_bytes

    def __repr__(self) -> str:
        return f"TransferMeter(weights={self.weights}, inputs={self.inputs})"


class _State:
    """The meters on now, and (non-strict virtual accelerators) where tensors and running components are."""

    meters: list[TransferMeter] = []
    tracking = False  # devices do not say where tensors are: plain-CPU virtual accelerators
    executing: list[Device] = []  # places of the components running now, innermost last
    tags: dict[int, tuple[weakref.ref, Device]] = {}


@contextmanager
def measure_transfers() -> Iterator[TransferMeter]:
    """Count the bytes our hooks move while the block runs (meters may nest)."""
    meter = TransferMeter()
    if not _State.meters:
        _State.tracking = virtual_accelerator_count() is not None and not strict_virtual_accelerators()
        _State.executing.clear()
        _State.tags.clear()
    _State.meters.append(meter)
    try:
        yield meter
    finally:
        _State.meters.remove(meter)
        if not _State.meters:
            _State.executing.clear()
            _State.tags.clear()


def metering() -> bool:
    return bool(_State.meters)


def direction(source: Device, target: Device) -> Direction | None:
    """The direction of a copy from `source` to `target`; None when it crosses no bus."""
    if is_accelerator(target):
        if not is_accelerator(source):
            return Direction.HOST_TO_ACCELERATOR
        return Direction.ACCELERATOR_TO_ACCELERATOR if source != target else None
    return Direction.ACCELERATOR_TO_HOST if is_accelerator(source) else None


def record(payload: Payload, num_bytes: int, *, source: Device, target: Device) -> None:
    if not _State.meters or num_bytes <= 0:
        return
    moved = direction(source, target)
    if moved is not None:
        for meter in _State.meters:
            meter.add(payload, moved, num_bytes, target=target)


tensor_bytes = storage_bytes  # what crosses the bus: a quantized tensor's packed data and scales


def tracking_places() -> bool:
    """Whether the meter tracks places itself: devices do not say them (plain-CPU virtual accelerators)."""
    return bool(_State.meters) and _State.tracking


def place_of_device(device: torch.device) -> Device:
    """The place of a real torch device: "cuda:1" -> 1, "mps" -> 0, "cpu" -> "cpu" ("meta" counts as host)."""
    if device.type in ("cpu", "meta"):
        return "cpu"
    return device.index or 0


def place_of(tensor: torch.Tensor) -> Device:
    """Where `tensor` is: its device's place; under plain-CPU virtual accelerators its tag, else the innermost
    running component's place, else the host."""
    if tensor.device.type != "cpu" or not _State.tracking:
        return place_of_device(tensor.device)
    tagged = _State.tags.get(id(tensor))
    if tagged is not None and tagged[0]() is tensor:
        return tagged[1]
    return _State.executing[-1] if _State.executing else "cpu"


def is_tagged(tensor: torch.Tensor) -> bool:
    return id(tensor) in _State.tags


def tag(tensor: torch.Tensor, place: Device) -> None:
    """Remember that the CPU tensor `tensor` now stands for a tensor on `place` (when tracking places)."""
    if not tracking_places() or tensor.device.type != "cpu":
        return
    key = id(tensor)
    if not is_accelerator(place):
        _State.tags.pop(key, None)
        return
    _State.tags[key] = (weakref.ref(tensor, lambda _ref, key=key: _State.tags.pop(key, None)), place)


def enter_place(place: Device) -> bool:
    """A component starts running on `place`; True when recorded (then call `leave_place`)."""
    if not tracking_places():
        return False
    _State.executing.append(place)
    return True


def leave_place(place: Device) -> None:
    """Undo the innermost `enter_place(place)` (a raise inside a component may have left others above it)."""
    stack = _State.executing
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] == place:
            del stack[index:]
            return


__all__ = ["Direction", "Payload", "Traffic", "TransferMeter", "measure_transfers", "metering", "place_of",
           "record", "tag", "tensor_bytes", "tracking_places"]

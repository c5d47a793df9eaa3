"""Limits of a `call=` checked from its numbers alone, before any activation is estimated.

Estimating a call's activations runs each component on fake tensors, and a VAE decode too large for its device is
estimated tiled, tile by tile: `call={"height": 1000000, "width": 1000000}` would loop over millions of tiles
for minutes. Some tensors of a call are certain whatever the models do, and each lives whole on one device:
- the decoded output: height x width x frames x images, 3 channels, at 2 bytes at the fewest (a VAE decodes in
  16 bits or more; tiling decodes tiles, but blends them into one output tensor);
- the prompt's token ids: max_sequence_length x prompts x images, int64.
One of them larger than the largest budget of a single device is refused at once, with the numbers.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from placement.budgets import resolve_budgets
from placement.devices import device_label
from placement.errors import DoesNotFitError
from placement.sizes import format_bytes

_CHANNELS, _DECODE_BYTES, _TOKEN_BYTES = 3, 2, 8


def check_call_limits(call: Mapping[str, Any], max_memory: Mapping | None, *, pipe: Any = None) -> None:
    """A `DoesNotFitError` naming the call's numbers when a tensor the call must hold whole (its decoded output,
    its token ids) is larger than every single device's budget. Only the keys `pipe` takes are weighed (our
    pipelines say by `activation_inputs`' parameters): a key it does not take is the call's own error, later."""
    call = {key: value for key, value in call.items() if _takes(pipe, key)}
    budgets = resolve_budgets(max_memory)
    devices = {device: limit for device, limit in budgets.limits.items() if device != "disk" and limit is not None}
    if not devices:
        return
    largest = max(devices, key=devices.get)
    copies = _number(call, "batch_size") * _number(call, "num_images_per_prompt")
    needs = []
    if _given(call, "height") and _given(call, "width"):
        pixels = call["height"] * call["width"] * _number(call, "num_frames") * copies
        numbers = ", ".join(f"{key}={call[key]}" for key in ("height", "width", "num_frames", "batch_size",
                                                              "num_images_per_prompt") if _given(call, key))
        needs.append((pixels * _CHANNELS * _DECODE_BYTES,
                      f"its decoded output ({numbers}: {pixels:,} pixels x {_CHANNELS} channels x {_DECODE_BYTES} "
                      "bytes at the fewest)"))
    if _given(call, "max_sequence_length"):
        tokens = call["max_sequence_length"] * copies
        needs.append((tokens * _TOKEN_BYTES, f"its token ids (max_sequence_length={call['max_sequence_length']}: "
                                             f"{tokens:,} tokens x {_TOKEN_BYTES} bytes)"))
    for size, what in needs:
        if size > devices[largest]:
            raise DoesNotFitError(
                f"call={dict(call)!r} needs {format_bytes(size)} for {what}, held whole on one device, more than "
                f"the largest budget ({device_label(largest)}: {format_bytes(devices[largest])}). Nothing was "
                "estimated: ask for a smaller call, or give a device that can hold it."
            )


def _takes(pipe: Any, key: str) -> bool:
    describe = getattr(pipe, "activation_inputs", None)
    if describe is None:
        return True  # a diffusers family: its call keys are checked against its table when estimated
    parameters = inspect.signature(describe).parameters
    return key in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _given(call: Mapping[str, Any], key: str) -> bool:
    value = call.get(key)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(call: Mapping[str, Any], key: str) -> int:
    return call[key] if _given(call, key) else 1


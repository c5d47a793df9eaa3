"""Which device an operation on virtual-accelerator tensors runs on, and the error when its inputs disagree.

The rules are CUDA's, so that a CPU test fails where a GPU run would:
- every tensor argument must be on one device; a 0-dim CPU tensor is the one exception (a "CPU scalar", which
  CUDA's elementwise kernels accept next to device tensors);
- indexing ops also take CPU index tensors (`x[cpu_indices]`, `index_put_`), as CUDA does;
- `copy_` and `_to_copy` cross devices by design (they are how tensors move);
- a random op on a device needs a generator of that device type (a CPU generator is an error, as on CUDA).
The message is torch's own ("Expected all tensors to be on the same device, but found at least two devices,
cuda:0 and cuda:1!"), with the virtual devices' names and the operation appended.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

aten = torch.ops.aten

# Ops whose index arguments may stay on the CPU next to a device tensor (CUDA moves them itself).
CPU_INDICES_ALLOWED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_,
                                 aten._unsafe_index, aten._unsafe_index_put})


def common_device(func, tensors: Sequence[torch.Tensor], *, cpu_indices: Sequence[torch.Tensor] = ()) -> torch.device:
    """The one device of `tensors` (in argument order; CPU scalars aside), else a RuntimeError (as torch raises on CUDA) naming the
    first two devices found. `cpu_indices` are index tensors that may stay on the CPU (CPU_INDICES_ALLOWED)."""
    allowed = {id(tensor) for tensor in cpu_indices}
    found: torch.device | None = None
    for tensor in tensors:
        device = tensor.device
        if device.type == "cpu" and (tensor.dim() == 0 or id(tensor) in allowed):
            continue
        if found is None:
            found = device
        elif device != found:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{found} and {device}! (in {func}, on virtual accelerators: PLACEMENT_VIRTUAL_ACCELERATORS)"
            )
    return torch.device("cpu") if found is None else found  # only CPU scalars: the result stays on the CPU


def check_generator(func, generator, device: torch.device) -> None:
    """A random op on `device` draws from a generator of that device type (CUDA: "Expected a 'cuda' device type
    for generator but found 'cpu'"); draw on the CPU and move the result instead, as diffusers' randn_tensor does."""
    if generator is not None and generator.device.type != device.type:
        raise RuntimeError(
            f"Expected a '{device.type}' device type for generator but found '{generator.device.type}' (in {func}, "
            "on virtual accelerators: draw on the generator's device and move the result)"
        )

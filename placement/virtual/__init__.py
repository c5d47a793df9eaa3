"""Strict virtual accelerators: the test mode `PLACEMENT_VIRTUAL_ACCELERATORS=N` as N devices torch tells apart.

Each tensor belongs to the virtual device it was moved to (`tensor.device == torch.device("vgpu", k)`); an
operation that mixes two devices (two virtual accelerators, or one and a non-scalar CPU tensor) raises the error
CUDA raises, so a CPU test fails where a multi-GPU run would. The bytes stay in RAM and every op runs on the CPU:
results are a CPU run's on the same tensors. `placement.devices.torch_device` is the one place that hands these
devices out.
"""

from .backend import BACKEND_NAME, ensure_backend
from .tensor import VirtualTensor, is_virtual

__all__ = ["BACKEND_NAME", "VirtualTensor", "ensure_backend", "is_virtual"]

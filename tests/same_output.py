"""The one rule for comparing floating results in this suite: two code paths that compute the same thing (a placed
pipeline and diffusers' own plain load, a dispatched model and its twin, a model read back and the one saved) are
compared with `assert_same_output`, never with `torch.equal`.

Why not bit for bit. The same numbers in the same order of operations can still round differently when the bytes
sit elsewhere or the work is split otherwise, and which way depends on the CPU:
- CPU BLAS (MKL, which torch's x86 wheels use) picks its GEMM blocking by the operands' address alignment and the
  thread split. A weight memory-mapped from a safetensors file sits at the file's offset (8 bytes past a 64-byte
  line is common); the same weight moved to a device (a GPU in use, a strict virtual one in these tests) is a fresh,
  aligned allocation. Measured on a 2-core AMD EPYC (AVX-512): 12 of 15 misaligned copies of a 32x32 weight give
  another 1x32 @ 32x32 product, in the last bit (on the CPU family the suite was first green on, these cases were
  bit-identical). With `MKL_CBWR=AUTO,STRICT` none differ: a setting of the machine, not a property of ours.
- Kernels that pick their path by size, layout or thread count (oneDNN convolutions, fused attention).
So a placed run equals a plain run to a few ulps, and which ulps differ changes from one CPU to the next.

The strict virtual backend (`placement/virtual.py`) removes every difference it can: each aten op runs on the
same CPU tensors, with the same sizes, strides and requires_grad flags, through the same C++ kernels (composite ops
under inference_mode are decomposed by their C++ kernel, not torch's Python decompositions; views keep their base's
requires_grad, which matmul reads to choose one mm or a batched one). With operands allocated alike it equals a CPU
run bit for bit (tests/placement/test_strict_virtual_accelerators.py holds that exactly). What it cannot copy is
where a CPU run's bytes were: the alignment of a memory-mapped checkpoint.

The tolerance. `torch.testing.assert_close`'s defaults for the dtype: for fp32 rtol 1.3e-6 (about 11 ulps) and atol
1e-5. The outputs compared here are O(1) values from tiny models a few layers and steps deep; the differences seen
are 1.2e-7 to 4.8e-7 (1 to 4 ulps), so the bound leaves a wide margin while a placement bug (a wrong device's
weights, a block run twice, a missed step) moves outputs by 1e-2 or more. Half precision rounds every op output to
10 (fp16) or 7 (bf16) bits, and two kernels' reassociated sums differ by about one ulp of the sum, which compounds
with depth: a few ulps at 1 for each (fp16 2e-3, bf16 1.6e-2).

A CUDA run against a CPU run (the gpu-marked tests) differs by kernel, not by a few ulps (TF32 convolutions, other
reductions): those tests state their own wider bound beside the comparison.

Exact stays exact: bytes moved (the transfer meter), tensors read back from a file, weights after a round trip or a
cast, device maps, hook counts, token ids, and the same module called twice on the same input (determinism, or a
technique that says it does nothing at this size). Those use `torch.equal`, with the reason beside it where it is
not obvious.
"""

from __future__ import annotations

import torch

# (rtol, atol) per dtype for outputs two code paths compute; see the module docstring for where each comes from.
TOLERANCES = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance_for(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for results of `dtype`; integers and booleans compare exactly."""
    if not dtype.is_floating_point and not dtype.is_complex:
        return 0.0, 0.0
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


def assert_same_output(actual: torch.Tensor, expected: torch.Tensor, *, msg: str | None = None) -> None:
    """`actual` equals `expected` as two code paths computing the same result can: same shape and dtype, values
    within the dtype's tolerance (`TOLERANCES`). Either may be on a (virtual) accelerator: values compare on the CPU."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    rtol, atol = tolerance_for(expected.dtype)
    described = (lambda default: f"{msg}: {default}") if msg else None
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=described)


def same_output(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether `assert_same_output` would pass (for tests that ask it of several results, or expect a difference)."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    rtol, atol = tolerance_for(expected.dtype)
    return torch.allclose(actual, expected, rtol=rtol, atol=atol)

"""Activation estimates: accuracy against real runs, and how long an estimate takes at real sizes.

    python benchmarks/activation_accuracy.py            # a few minutes on a 2-core machine
    python benchmarks/activation_accuracy.py --quick    # fewer sizes

Table 1 (accuracy, CPU): for each component of the tiny presets (`tiny-sd15`, `tiny-flux`: diffusers' and
transformers' classes at tiny widths, random weights), at several image sizes, our estimate (`ExampleCall.estimate`
on the meta copy of the component, its inputs captured from the pipeline's own `__call__`) against the peak
measured by really running the component on CPU under torch's MemTracker
(`placement.activations.estimate.measure_activations`). "math path" is what a plain meta/fake run gives when
attention is left to the math fallback (the N x N score matrix), as ratios to the measured peak. The "sd-vae" rows
use the real SDXL VAE (diffusers' AutoencoderKL at its published config).

Table 2 (speed, meta): the estimate for each component of the real presets (`sdxl`, `flux`: the published
configs on meta, bf16) at 512 and 1024, its size and the wall and CPU seconds it took (target: FLUX's transformer
at 1024 < 2 s), and for that row the same fake run tracked by torch's MemTracker, for comparison.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from pipelines.hf.calls.capture import ExampleCall
from pipelines.loading.planning import describe_call, modules_and_edges
from pipelines.presets import catalog, real_folders
from placement.activations.estimate import activation_peak, measure_activations
from placement.activations.tracking import LiveStorageTracker
from placement.activations.estimate import _FakeCopies

MiB = 2**20
GiB = 2**30


class MathPathAttention(TorchFunctionMode):
    """SDPA as the math fallback computes it: the full score matrix, its softmax, then the product."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = dict(zip(("query", "key", "value"), args))  # diffusers passes them by keyword
        query, key, value = (kwargs.get(name, named.get(name)) for name in ("query", "key", "value"))
        scores = query @ key.transpose(-2, -1) * query.shape[-1] ** -0.5
        return scores.softmax(dim=-1) @ value


def math_path_estimate(module, call: ExampleCall) -> int:
    """The estimate without fused-attention accounting (what meta execution of SDPA costs)."""
    fake_mode = FakeTensorMode()
    copies = _FakeCopies(fake_mode, None)  # no dtype: every tensor as it is
    weights = copies.module_tensors(module)
    args, kwargs = copies.inputs((call.args, dict(call.kwargs)))
    tracker = LiveStorageTracker()
    tracker.exclude(weights.values())
    tracker.count(tree_leaves((args, kwargs)))
    with torch.inference_mode(), fake_mode, _reparametrize_module(module, weights), MathPathAttention(), tracker:
        getattr(module, call.method)(*args, **kwargs)
    return tracker.peak_bytes


def real_inputs(call: ExampleCall):
    def materialize(tensor):
        if not tensor.is_meta:  # ids and masks whose values the capture kept
            return tensor
        if tensor.is_floating_point():
            return torch.randn(tensor.shape, dtype=tensor.dtype)
        return torch.ones(tensor.shape, dtype=tensor.dtype)

    return tree_map_only(torch.Tensor, materialize, (call.args, dict(call.kwargs)))


def component_calls(pipe, side: int, dtype=None) -> dict[str, ExampleCall]:
    """Each module component's first call in `pipe(prompt, height=side, width=side)`, learned from the pipeline's own
    `__call__` (call capture, as planning learns it)."""
    modules, _ = modules_and_edges(pipe)
    described = describe_call(pipe, modules, {"height": side, "width": side, "num_inference_steps": 1}, dtypes=dtype)
    return {name: calls[0] for name, calls in described.calls.items() if calls}


def on_meta(pipe):
    """`pipe` with a meta copy of each module component (shapes and dtypes kept, no storage)."""
    modules, _ = modules_and_edges(pipe)
    copies = {name: copy.deepcopy(module).to("meta") for name, module in modules.items()}
    cls = type(pipe)
    expected, _ = cls._get_signature_keys(cls)
    return cls(**{name: copies.get(name, getattr(pipe, name, None)) for name in expected})


def accuracy_rows(sides: tuple[int, ...]):
    import diffusers

    for preset in ("tiny-sd15", "tiny-flux"):
        pipeline_class, _ = catalog.TINY_PRESETS[preset]
        real = getattr(diffusers, pipeline_class).from_pretrained(catalog.preset_folder(preset))
        meta = on_meta(real)
        for side in sides:
            for name, call in component_calls(meta, side).items():
                yield _accuracy_row(f"{preset}/{name}", side, getattr(meta, name), getattr(real, name), call)
    # The real SDXL VAE decoder (128..512 channels), decoded for real at 128 and 256 pixels.
    config = real_folders.PIPELINES["sdxl-base-1.0"]["components"]["vae"]["config"]
    with torch.device("meta"):
        vae_on_meta = diffusers.AutoencoderKL.from_config(config).eval()
    vae = diffusers.AutoencoderKL.from_config(config).eval()
    for side in (128, 256):
        latents = torch.empty(1, vae.config.latent_channels, side // 8, side // 8, device="meta")
        yield _accuracy_row("sd-vae/decode", side, vae_on_meta, vae, ExampleCall(args=(latents,), method="decode"))


def _accuracy_row(label, side, module_on_meta, module, call):
    started = time.perf_counter()
    estimate = call.estimate(module_on_meta)
    seconds = time.perf_counter() - started
    args, kwargs = real_inputs(call)
    measured = measure_activations(module, args, kwargs, method=call.method)
    math_path = math_path_estimate(module_on_meta, call)
    return label, side, estimate, measured, math_path, seconds


def memtracker_estimate(module, call: ExampleCall, dtype) -> int:
    """The same fake run measured by torch's MemTracker instead of LiveStorageTracker (for the timing)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from placement.activations.fake_tensors import FusedAttentionAccounting

    fake_mode = FakeTensorMode()
    copies = _FakeCopies(fake_mode, dtype)
    weights = copies.module_tensors(module)
    for weight in weights.values():  # MemTracker installs gradient hooks on every parameter it sees
        weight.requires_grad_(weight.is_floating_point())
    args, kwargs = copies.inputs((call.args, dict(call.kwargs)))
    with torch.inference_mode(), fake_mode, _reparametrize_module(module, weights), FusedAttentionAccounting():
        tracker = MemTracker()
        tracker.track_external(module, *[leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)])
        with tracker:
            getattr(module, call.method)(*args, **kwargs)
    return activation_peak(tracker)


def timed(fn, repeats: int = 2):
    """(result, best wall seconds, best CPU seconds) over `repeats` runs: the machine may be shared."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - wall), min(best_cpu, time.process_time() - cpu)
    return result, best_wall, best_cpu


def speed_rows(sides: tuple[int, ...]):
    for preset in ("sdxl", "flux"):
        pipe = real_folders.meta_pipeline(catalog.REAL_PRESETS[preset])
        for side in sides:
            for name, call in component_calls(pipe, side, torch.bfloat16).items():
                module = getattr(pipe, name)
                estimate, wall, cpu = timed(lambda: call.estimate(module, dtype=torch.bfloat16))
                yield f"{preset}/{name}", side, estimate, wall, cpu
                if preset == "flux" and name == "transformer" and side == max(sides):
                    reference, wall, cpu = timed(lambda: memtracker_estimate(module, call, torch.bfloat16), 1)
                    yield f"  same, with MemTracker", side, reference, wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    options = parser.parse_args()
    torch.manual_seed(0)
    accuracy_sides = (64, 128) if options.quick else (64, 128, 256)

    print("Accuracy (CPU, float32): estimate vs a real run measured by MemTracker")
    print(f"{'component':28s} {'pixels':>7s} {'measured MiB':>13s} {'estimate MiB':>13s} {'est/meas':>9s} "
          f"{'math-path/meas':>15s} {'estimate s':>11s}")
    worst = 0.0
    for label, side, estimate, measured, math_path, seconds in accuracy_rows(accuracy_sides):
        worst = max(worst, abs(estimate / measured - 1))
        print(f"{label:28s} {side:>7d} {measured / MiB:>13.2f} {estimate / MiB:>13.2f} {estimate / measured:>9.3f} "
              f"{math_path / measured:>15.2f} {seconds:>11.2f}")
    print(f"worst |estimate/measured - 1| = {worst:.3%} (target <= 10%)\n")

    print("Speed (meta, bf16): real-size presets, best of 2 runs")
    print(f"{'component':28s} {'pixels':>7s} {'estimate GiB':>13s} {'wall s':>8s} {'cpu s':>8s}")
    for label, side, estimate, wall, cpu in speed_rows((512, 1024)):
        target = "  (target < 2 s on a laptop CPU)" if label == "flux/transformer" and side == 1024 else ""
        print(f"{label:28s} {side:>7d} {estimate / GiB:>13.3f} {wall:>8.2f} {cpu:>8.2f}{target}")


if __name__ == "__main__":
    main()

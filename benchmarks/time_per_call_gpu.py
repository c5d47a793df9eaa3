"""Measured against predicted seconds per call on this machine's GPU (issue 29's `--gpu` mode of time_per_call.py).

    python benchmarks/time_per_call_gpu.py            # about a minute on an H200; needs CUDA
    python benchmarks/time_per_call.py --gpu          # the same

diffusers' FluxPipeline with a real-shaped transformer (FLUX.1's width, heads and block layout, `DEPTH` of its layers;
the tiny-flux preset's text encoders, and a tiny VAE with FLUX's 16 latent channels and 8x downsampling, so the
transformer sees FLUX's token counts) is built from random weights in a temporary folder (no network) and loaded
twice with `pipelines.Pipeline.from_pretrained(call=, gpu=)`: resident (every weight on the GPU) and under
a GPU budget that holds `STREAM_SHARE` of the denoiser, so its other blocks stream at every step. Each load's plan
predicts its seconds per call, on the GPU measured (`gpu="measure"`: a matmul and a pinned copy) and on the table's
profile for its name. Each call is then timed (the best of `CALLS`, after a warm-up call that also learns the block
order), and one streamed call is recorded by `hooks.trace_calls()`. Printed, as measured / predicted ratios (the
target: within 20%):
- seconds per call, resident and streamed;
- the copy time compute does not hide: measured as streamed - resident, and read from the trace (the time some copy
  is in flight on the GPU and no block computes), against the plan's exposed seconds;
- the pinned host -> GPU bandwidth: the copies of the trace (bytes / seconds in flight) and the link measurement,
  against the table profile's link.
Without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

GiB = 1024**3
DEPTH = (1, 6)  # FLUX's double and single layers kept: ~1.2B parameters, 2.4 GB in bf16
CALL = {"height": 1024, "width": 1024, "num_inference_steps": 8}
STREAM_SHARE = 0.5  # the share of the denoiser the streaming budget holds
CALLS = 3
PROMPT = "a red cube"
NEEDS_GPU = "time_per_call_gpu.py measures on a CUDA GPU and torch.cuda.is_available() is False here: nothing measured."


@dataclass(frozen=True)
class Measured:
    """One load's prediction and measurement."""

    label: str
    plan: object  # placement.Plan
    seconds: float  # the best call
    trace: object | None  # hooks.CallTrace of one call, when traced


def build(folder: Path, *, depth=DEPTH, hidden: int = 3072, heads: int = 24) -> Path:
    """diffusers' FluxPipeline with a FLUX-shaped transformer of `depth` (double, single) layers, saved to `folder`
    in bf16 (the tiny-flux preset's text encoders; a tiny VAE that downsamples 8x into 16 channels, as FLUX's)."""
    import diffusers

    from pipelines.presets.catalog import preset_folder

    pipe = diffusers.FluxPipeline.from_pretrained(preset_folder("tiny-flux"))
    text = pipe.transformer.config
    head = hidden // heads
    rope = (head // 8, (head - head // 8) // 2, head - head // 8 - (head - head // 8) // 2)  # FLUX: 16, 56, 56
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=[8] * 4, layers_per_block=1,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=16,
        norm_num_groups=2, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159,
        scaling_factor=0.3611).eval()
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=depth[0], num_single_layers=depth[1], attention_head_dim=head,
        num_attention_heads=heads, joint_attention_dim=text.joint_attention_dim,
        pooled_projection_dim=text.pooled_projection_dim, guidance_embeds=True, axes_dims_rope=rope).eval()
    pipe.register_modules(transformer=transformer, vae=vae)
    pipe.to(torch.bfloat16).save_pretrained(folder)
    return folder


def load(folder: Path, max_memory, *, gpu, call):
    import pipelines

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plan states its own warnings; the ratios are the output here
        pipe = pipelines.Pipeline.from_pretrained(folder, device_map="auto", max_memory=max_memory,
                                                  torch_dtype=torch.bfloat16, call=call, gpu=gpu, progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def timed_calls(pipe, call, *, calls: int = CALLS, trace: bool) -> tuple[float, object | None]:
    """The best of `calls` timed calls (after one warm-up), and one more call traced when `trace`."""
    from hooks import trace_calls

    def one() -> float:
        _synchronize()
        start = time.perf_counter()
        pipe(PROMPT, **call, output_type="pt", generator=torch.Generator().manual_seed(0))
        _synchronize()
        return time.perf_counter() - start

    one()  # warm-up: kernels chosen, the streamed blocks' order learned
    best = min(one() for _ in range(calls))
    if not trace:
        return best, None
    with trace_calls() as recorded:
        one()
    return best, recorded


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(folder: Path, *, budgets, gpu, call=CALL, calls: int = CALLS) -> list[Measured]:
    """Each (label, max_memory) of `budgets` loaded, predicted and timed (the streamed one traced)."""
    results = []
    for label, max_memory in budgets:
        pipe = load(folder, max_memory, gpu=gpu, call=call)
        seconds, trace = timed_calls(pipe, call, calls=calls, trace=label != "resident")
        results.append(Measured(label, pipe.placement_plan, seconds, trace))
        del pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def streaming_budget(folder: Path, *, gpu, call=CALL) -> dict:
    """max_memory that keeps `STREAM_SHARE` of the denoiser resident: the resident plan's GPU peak, less the rest."""
    import pipelines

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resident = pipelines.Pipeline.plan_placement(folder, max_memory={0: 100 * GiB, "cpu": 100 * GiB},
                                                     call=call, gpu=gpu, torch_dtype=torch.bfloat16)
    peak = resident.device(0).predicted_peak
    denoiser = resident.components["transformer"].bytes
    return {0: int(peak - (1 - STREAM_SHARE) * denoiser), "cpu": 100 * GiB}


def trace_figures(trace) -> dict[str, float]:
    """From a traced call: seconds some copy is in flight while no block computes (exposed), copy seconds and
    bytes (the copies' own bandwidth)."""
    from placement.drawings import COMPUTE_END, COMPUTE_START, COPY_DONE, COPY_ISSUED

    copies, computes, opened, copied = [], [], {}, 0
    for event in trace.events:
        key = (event.component, event.block)
        if event.kind in (COPY_ISSUED, COMPUTE_START):
            opened[(event.kind, key)] = event.time_us
        elif event.kind == COPY_DONE and (COPY_ISSUED, key) in opened:
            copies.append((opened.pop((COPY_ISSUED, key)), event.time_us))
            copied += event.nbytes
        elif event.kind == COMPUTE_END and event.block and (COMPUTE_START, key) in opened:
            computes.append((opened.pop((COMPUTE_START, key)), event.time_us))
    copy_us = _length(_union(copies))
    exposed_us = copy_us - _length(_intersection(_union(copies), _union(computes)))
    return {"exposed_s": exposed_us / 1e6, "copy_s": copy_us / 1e6, "copied_bytes": copied,
            "copy_bytes_per_s": copied / (copy_us / 1e6) if copy_us else 0.0}


def _union(spans):
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intersection(a, b):
    return [(max(s1, s2), min(e1, e2)) for s1, e1 in a for s2, e2 in b if min(e1, e2) > max(s1, s2)]


def _length(spans) -> float:
    return sum(end - start for start, end in spans)


def report(results: list[Measured], named: str) -> list[str]:
    """The lines printed: per load, predicted (measured GPU, table profile) vs measured, then the overlap and
    the bandwidth of the streamed one."""
    from placement.gpu_profiles import gpu_profile

    table = gpu_profile(named)
    lines = [f"{'load':<10}{'measured s':>12}{'predicted s':>13}{'ratio':>9}{'table s':>10}{'ratio':>9}"
             f"{'moves/call':>12}   (predicted on {results[0].plan.gpu_source}; table: {table.name})"]
    for result in results:
        predicted, on_table = result.plan.seconds_per_call, result.plan.time_per_call(table).seconds
        lines.append(f"{result.label:<10}{result.seconds:>12.3f}{predicted:>13.3f}{result.seconds / predicted:>9.2f}"
                     f"{on_table:>10.3f}{result.seconds / on_table:>9.2f}"
                     f"{result.plan.transfer_bytes_per_call / GiB:>10.2f}GiB")
    resident, streamed = results[0], results[-1]
    if streamed.trace is None or not streamed.plan.transfer_bytes_per_call:
        return lines + ["The streaming budget moved nothing per call: no overlap to measure."]
    seen = trace_figures(streamed.trace)
    predicted = streamed.plan.time_per_call()
    lines += [
        f"exposed copy s: measured streamed - resident {streamed.seconds - resident.seconds:.3f}, in the trace "
        f"{seen['exposed_s']:.3f}; predicted {predicted.exposed_s:.3f} (of {predicted.copy_s:.3f} s copied); ratios "
        f"{_ratio(streamed.seconds - resident.seconds, predicted.exposed_s)} and "
        f"{_ratio(seen['exposed_s'], predicted.exposed_s)}",
        f"pinned host -> GPU: the trace's copies {seen['copy_bytes_per_s'] / 1e9:.1f} GB/s "
        f"({seen['copied_bytes'] / GiB:.2f} GiB), the plan's link {streamed.plan.link_bandwidth / 1e9:.1f} GB/s "
        f"({streamed.plan.link_bandwidth_source}); the table's {table.link_bytes_per_s / 1e9:.1f} GB/s; ratios "
        f"trace / table {_ratio(seen['copy_bytes_per_s'], table.link_bytes_per_s)}, link / table "
        f"{_ratio(streamed.plan.link_bandwidth, table.link_bytes_per_s)}",
        "within 20%: " + ", ".join(f"{r.label} {'yes' if abs(r.seconds / r.plan.seconds_per_call - 1) <= 0.2 else 'no'}"
                                   for r in results),
    ]
    return lines


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted else "n/a (predicted 0)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="accepted, as time_per_call.py --gpu passes it")
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_GPU)
        return 0
    from placement.gpu_profiles import match_device_name

    known = match_device_name(torch.cuda.get_device_name())
    named = known.key if known is not None else "h100"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="time-per-call-gpu-") as scratch:
        folder = build(Path(scratch) / "pipeline")
        print(f"Built and saved a Flux-shaped pipeline ({DEPTH[0]} double, {DEPTH[1]} single layers) in "
              f"{time.perf_counter() - started:.0f} s; call {CALL}, best of {CALLS} calls")
        budgets = [("resident", {0: 100 * GiB, "cpu": 100 * GiB}),
                   ("streamed", streaming_budget(folder, gpu="measure"))]
        results = measure(folder, budgets=budgets, gpu="measure")
    print("\n".join(report(results, named)))
    print(f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())

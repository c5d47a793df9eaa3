"""Ready for a GPU (issue 38): one script to run when a device is lent.

    python benchmarks/gpu_check.py               # a CUDA machine: about 4 minutes on an H100
    python benchmarks/gpu_check.py --cpu         # any machine: virtual GPUs, a narrow DiT, under a minute

1. `placement calibrate` measures the machine into a profile (a scratch cache folder unless --cache DIR), which
   every plan below uses and names.
2. The `gpu`-marked tests (`python -m pytest -m gpu tests`); not in --cpu mode, where they would all skip.
3. diffusers' FluxTransformer2DModel at FLUX's width (3072, 24 heads; `time_per_call_gpu.DEPTH` of its layers; --cpu:
   64 wide, 2 heads) from random weights, in a FluxPipeline with tiny text encoders and VAE, placed three ways: resident (every weight on
   the GPU), streamed (a GPU budget holding half the denoiser: the rest streams at every step) and per call (the
   denoiser's blocks loaded once per call from CPU RAM). Each is called (a warm-up, then timed calls, then one
   traced), and printed: measured vs predicted seconds per call, the trace's overlap (copy seconds no block
   computes through, against the plan's exposed seconds) and `pipe.placement_report()`, whose corrections go to
   the profile the next placement is planned with.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import time_per_call_gpu as timing  # noqa: E402  (the pipeline, the loads, the trace's figures)

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3
DENOISER = "transformer"  # FluxPipeline's


class Mode:
    """What differs between a GPU and the CPU check."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.depth = (1, 3) if cpu else timing.DEPTH
        self.hidden, self.heads = (64, 2) if cpu else (3072, 24)
        self.call = {"height": 64, "width": 64, "num_inference_steps": 2} if cpu else timing.CALL
        self.calls = 1 if cpu else timing.CALLS
        self.calibrate = ["--quick", "--seconds", "0.05"] if cpu else ["--seconds", "0.5"]


def run_calibrate(mode: Mode, env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "calibrate", *mode.calibrate], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return [f"calibrate (exit {done.returncode}):", *(f"  {line}" for line in lines)]


def run_gpu_tests(mode: Mode, env: dict, timeout: int) -> list[str]:
    if mode.cpu:
        return ["gpu tests: not run in --cpu mode (each needs CUDA and would skip)"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"gpu tests: stopped after {timeout} s"]
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    return [f"gpu tests (exit {done.returncode}):", *(f"  {line}" for line in tail)]


def per_call_plan(plan, pipe):
    """`plan` (a resident one) with the denoiser's blocks homed in CPU RAM and loaded once per call."""
    from placement.plan_schema import ComponentTransfer, PlacementKind

    denoiser = pipe.components[DENOISER]
    lists = ("transformer_blocks", "single_transformer_blocks")  # FLUX's double- and single-stream blocks
    moved = sum(t.numel() * t.element_size() for path in lists for t in denoiser.get_submodule(path).parameters())
    component = plan.components[DENOISER]
    transfer = ComponentTransfer(resident_bytes=component.bytes - moved, loaded_per_call_bytes=moved,
                                 streamed_per_run_bytes=0, per_call_modules=list(lists), streamed_modules=[],
                                 runs_per_call=component.transfer.runs_per_call if component.transfer else 1)
    update = dict(kind=PlacementKind.OFFLOADED, device_map={"": 0, **{path: "cpu" for path in lists}},
                  devices=[0, "cpu"], placed_bytes={0: component.bytes - moved, "cpu": moved}, transfer=transfer)
    components = {**plan.components, DENOISER: component.model_copy(update=update)}
    # The GPU's room for per-call units is exactly the denoiser's blocks, so the next phase (the VAE's
    # activations) sends them back and every call loads them again (`hooks.residency.room_on`).
    resident = sum(c.placed_bytes.get(0, 0) for c in components.values())
    devices = [d.model_copy(update={"budget": d.overhead + resident + moved}) if d.device == 0 else d
               for d in plan.devices]
    return plan.model_copy(update={"components": components, "devices": devices})


def load_plan(folder: Path, plan):
    import pipelines

    pipe = pipelines.Pipeline.from_pretrained(folder, device_map=plan, torch_dtype=torch.bfloat16, progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def place_three_ways(mode: Mode, folder: Path) -> list[str]:
    resident_budget = {0: 100 * GiB if not mode.cpu else 4 * GiB, "cpu": 100 * GiB if not mode.cpu else 8 * GiB}
    lines = []
    resident = timing.load(folder, resident_budget, gpu=None, call=mode.call)
    per_call = per_call_plan(resident.placement_plan, resident)
    loads = [("resident", lambda: resident), ("streamed", lambda: timing.load(
        folder, timing.streaming_budget(folder, gpu=None, call=mode.call), gpu=None, call=mode.call)),
        ("per call", lambda: load_plan(folder, per_call))]
    for label, loaded in loads:
        pipe = loaded()
        seconds, trace = timing.timed_calls(pipe, mode.call, calls=mode.calls, trace=label != "resident")
        plan = pipe.placement_plan
        predicted = plan.seconds_per_call
        lines.append(f"{label}: measured {seconds:.3f} s per call (best of {mode.calls}), predicted {predicted:.3f} s "
                     f"({seconds / predicted:.2f}x); moves {plan.transfer_bytes_per_call / GiB:.3f} GiB per call")
        if trace is not None and plan.transfer_bytes_per_call:
            seen = timing.trace_figures(trace)
            time_ = plan.time_per_call()
            lines.append(f"  overlap: copies {seen['copy_s']:.3f} s in flight, {seen['exposed_s']:.3f} s of it with "
                         f"no block computing; predicted {time_.copy_s:.3f} s copied, {time_.exposed_s:.3f} s exposed;"
                         f" copies ran {seen['copy_bytes_per_s'] / 1e9:.2f} GB/s")
        lines += [f"  {line}" for line in pipe.placement_report().splitlines()]
        del pipe, loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="virtual GPUs and a narrow DiT: runs anywhere, quickly")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the profile goes (default: a scratch folder, so a lent machine's user cache "
                             "stays untouched)")
    parser.add_argument("--tests-timeout", type=int, default=300, help="seconds the gpu tests may take")
    args = parser.parse_args(argv)
    mode = Mode(args.cpu or not torch.cuda.is_available())
    if not args.cpu and mode.cpu:
        print("No CUDA GPU here: running the --cpu check (virtual GPUs, a narrow DiT).")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        cache = args.cache or Path(scratch) / "cache"
        os.environ["PLACEMENT_CACHE_DIR"] = str(cache)  # this process's plans too
        if mode.cpu:
            os.environ["PLACEMENT_VIRTUAL_ACCELERATORS"] = "1"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        device = "a virtual GPU (the CPU)" if mode.cpu else torch.cuda.get_device_name()
        print(f"gpu_check on {device}; profile in {cache}", flush=True)
        print("\n".join(run_calibrate(mode, env)), flush=True)
        print("\n".join(run_gpu_tests(mode, env, args.tests_timeout)), flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folder = timing.build(Path(scratch) / "pipeline", depth=mode.depth, hidden=mode.hidden, heads=mode.heads)
        print(f"DiT {mode.hidden} wide, {mode.heads} heads, {mode.depth[0]} double + {mode.depth[1]} single layers, "
              f"random weights; call {mode.call}", flush=True)
        print("\n".join(place_three_ways(mode, folder)))
    print(f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

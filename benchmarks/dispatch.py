"""Dispatch benchmark: forward time and hook count of our dispatch vs accelerate's `dispatch_model(force_hooks=True)`
(what diffusers uses for `device_map=`), for a component placed whole on one device.

Layouts: diffusers' UNet2DConditionModel from SD1.5's published config (benchmarks/data/real_pipelines.json) and
FluxTransformer2DModel from FLUX.1-dev's, both at reduced width (and FLUX at few layers) so that a forward takes
milliseconds on 2 CPU cores: the hook overhead is per module call, so it is what the ratio shows, and it is the
same at full width. Hook counts are given for the full-size architecture too (built on meta: accelerate puts
one hook on every submodule, we put one at the top).

The device is virtual accelerator 0 (`PLACEMENT_VIRTUAL_ACCELERATORS=1`, backed by the CPU) for ours and
"cpu" for accelerate's: the same execution device, so the difference is the hooks alone. Each variant runs in
alternating rounds; per-forward time is the median of the fastest round's forwards, on one torch thread
(CPU time of the computing thread, which other jobs on a shared machine inflate less than wall time).

    python benchmarks/dispatch.py                # ~2 min on 2 cores
    python benchmarks/dispatch.py --rounds 5 --forwards 20
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

os.environ["PLACEMENT_VIRTUAL_ACCELERATORS"] = "1"  # read at call time; set before anything asks
# Not strict: strict virtual tensors add per-op device bookkeeping, which is not what this measures (the hooks).
os.environ["PLACEMENT_VIRTUAL_STRICT"] = "0"

import torch  # noqa: E402
from accelerate import dispatch_model, init_empty_weights  # noqa: E402
from accelerate.hooks import remove_hook_from_module  # noqa: E402

from hooks.dispatch import dispatch, undispatch  # noqa: E402
from pipelines.presets.real_folders import DATA as PIPELINES_DATA  # the published configs, package data

DATA = PIPELINES_DATA / "real_pipelines.json"


def published_config(pipeline: str, component: str) -> dict:
    return dict(json.loads(DATA.read_text())["pipelines"][pipeline]["components"][component]["config"])


def sd15_unet(full: bool):
    from diffusers import UNet2DConditionModel

    config = published_config("sd15", "unet")
    if not full:  # same blocks, attention layers and resnets; narrow channels
        config.update(block_out_channels=[32, 64, 64, 64], cross_attention_dim=64, attention_head_dim=4,
                      norm_num_groups=8)
    model = UNet2DConditionModel(**config)
    width = config["cross_attention_dim"]
    inputs = (torch.randn(1, 4, 16, 16), torch.tensor(10.0), torch.randn(1, 8, width))
    return model, inputs


def flux_transformer(full: bool):
    from diffusers import FluxTransformer2DModel

    config = {key: value for key, value in published_config("flux1-dev", "transformer").items()
              if not key.startswith("_")}
    if not full:  # 2 double + 4 single blocks (FLUX.1-dev: 19 + 38), narrow heads
        config.update(num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=4,
                      joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=[4, 6, 6])
    model = FluxTransformer2DModel(**config)
    tokens, text = 64, 16
    inputs = dict(
        hidden_states=torch.randn(1, tokens, config["in_channels"]),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"]),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"]),
        timestep=torch.tensor([0.5]), img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3),
        guidance=torch.tensor([3.5]) if config.get("guidance_embeds") else None,
    )
    return model, inputs


LAYOUTS = {"SD1.5 UNet": sd15_unet, "FLUX transformer": flux_transformer}


def hooked(model) -> int:
    return sum(1 for module in model.modules() if hasattr(module, "_hf_hook"))


def apply(variant: str, model) -> None:
    if variant == "ours":
        dispatch(model, {"": 0})
    elif variant == "accelerate":
        dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)


def remove(variant: str, model) -> None:
    if variant == "ours":
        undispatch(model)
    elif variant == "accelerate":
        remove_hook_from_module(model, recurse=True)


def forward_times(model, inputs, forwards: int) -> list[float]:
    times = []
    with torch.inference_mode():
        for _ in range(forwards):
            start = time.thread_time()
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)
            times.append(time.thread_time() - start)
    return times


def measure(build, rounds: int, forwards: int) -> dict[str, dict]:
    torch.manual_seed(0)
    model, inputs = build(full=False)
    model.eval()
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for variant in ("plain", "ours", "accelerate"):
            apply(variant, model)
            hooks = hooked(model)
            forward_times(model, inputs, 2)  # warm-up (accelerate imports torch._dynamo on its first hook call)
            median = statistics.median(forward_times(model, inputs, forwards))
            remove(variant, model)
            best = results.get(variant, {}).get("seconds", float("inf"))
            results[variant] = {"hooks": hooks, "seconds": min(best, median)}
    return results


def full_size_hooks(build) -> tuple[int, int]:
    """(ours, accelerate's) hook count at the published size, built on meta: accelerate's
    `attach_execution_device_hook` hooks every submodule holding any tensor (its state_dict is not empty);
    we hook the top."""
    with init_empty_weights():
        model, _ = build(full=True)
    return 1, sum(1 for module in model.modules() if len(module.state_dict()) > 0)


def split_crossings() -> list[tuple[str, int]]:
    """SD1.5's full UNet (on meta) split over two equal GPUs: device changes per forward between the entries of
    the split map, with units in registration order (as before), structural order, and traced order."""
    import dataclasses

    import placement
    from placement.sizing import size_module
    from placement.splitting import split_device_map
    from placement.unit_order import device_crossings, order_units, record_module_order

    with init_empty_weights():
        unet, _ = sd15_unet(full=True)
    inputs = (torch.empty(2, 4, 64, 64, device="meta"), torch.tensor(1.0, device="meta"),
              torch.empty(2, 77, 768, device="meta"))
    with record_module_order(unet, every_call=True) as calls:
        placement.estimate_activations(unet, inputs, dtype=torch.bfloat16)
    size = size_module(unet, torch.bfloat16)
    rooms = {0: size.total // 2 + size.largest_unit, 1: size.total // 2 + size.largest_unit}
    registration = [path for path, _ in unet.named_modules()]
    first_calls = list(dict.fromkeys(calls))
    rows = []
    for label, order in (("registration order (before)", registration), ("structural order", None),
                         ("traced order (call=)", first_calls)):
        units = size.split_units if order is None else order_units(size.split_units, order)
        device_map = split_device_map(unet, rooms, size=dataclasses.replace(size, split_units=units),
                                      dtype=torch.bfloat16)
        rows.append((label, device_crossings([c for c in calls if c in device_map], device_map)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forwards", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)  # its "offloaded to the cpu" notice
    header = (f"{'layout (reduced width)':<24}{'hooks ours':>11}{'hooks acc.':>11}{'full-size hooks':>17}"
              f"{'plain ms':>10}{'ours ms':>9}{'acc. ms':>9}{'ours/plain':>12}{'acc./plain':>12}{'acc./ours':>11}")
    print(header)
    print("-" * len(header))
    for name, build in LAYOUTS.items():
        result = measure(build, args.rounds, args.forwards)
        ours_full, theirs_full = full_size_hooks(build)
        plain, ours, theirs = (result[v]["seconds"] * 1000 for v in ("plain", "ours", "accelerate"))
        print(f"{name:<24}{result['ours']['hooks']:>11}{result['accelerate']['hooks']:>11}"
              f"{f'{ours_full} vs {theirs_full}':>17}{plain:>10.2f}{ours:>9.2f}{theirs:>9.2f}"
              f"{ours / plain:>12.2f}{theirs / plain:>12.2f}{theirs / ours:>11.2f}")
    print("\nms: median CPU time of one forward on one torch thread (best of the rounds); whole on one device.")
    print("\nSD1.5 UNet (full size, bf16, on meta) split over two equal GPUs: device changes per forward")
    for label, crossings in split_crossings():
        print(f"  {label:<30}{crossings:>3}")


if __name__ == "__main__":
    main()

"""Pooled residency end to end (issue 39): a denoiser too big for either GPU beside its activations, and too big for
both together beside the other components, keeps resident blocks on both GPUs (each GPU runs its span) and streams
the rest, as the library plans it for the call. On two strict virtual accelerators (every tensor on its `vgpu:k`,
a device mix-up raises as on CUDA), for a DiT (FLUX.1's FluxTransformer2DModel) and a UNet (UNet2DConditionModel)
in their diffusers pipelines: the output equals diffusers' plain run of the same folder, the second call moves
exactly the plan's host -> GPU bytes, activations cross between the GPUs, and each GPU's weights stay within what
the plan puts there."""

from __future__ import annotations

import pytest
import torch

from hooks import measure_transfers
from hooks.transfer_meter import Payload
from pipelines import Pipeline
from placement import planner
from placement.devices import is_accelerator
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD

from same_output import assert_same_output

diffusers = pytest.importorskip("diffusers")
import tiny_parts  # noqa: E402  (tests/pipelines/e2e, on the path through conftest)
import tiny_dits  # noqa: E402
import tiny_unets  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
STEPS = 3
ROOMY = {0: "8GiB", 1: "8GiB", "cpu": "8GiB"}


def flux(root):
    parts = tiny_dits._flux_parts(root)
    parts["transformer"] = tiny_parts.seeded(lambda: tiny_parts.flux_transformer(num_layers=2, num_single_layers=8))
    return diffusers.FluxPipeline(**parts), "transformer", {"max_sequence_length": 8}


def unet(root):
    parts = tiny_unets._sd_parts(root)
    parts["unet"] = tiny_parts.seeded(lambda: tiny_parts.sd_unet(
        block_out_channels=(8, 8, 16, 16), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")))
    return diffusers.StableDiffusionPipeline(**parts), "unet", {}


def inputs(extra) -> dict:
    return {"prompt": "a cat", "num_inference_steps": STEPS, "height": 16, "width": 16,
            "generator": torch.Generator().manual_seed(0), "output_type": "pt", **extra}


def planned_call(extra) -> dict:
    return {key: value for key, value in inputs(extra).items() if key not in ("generator", "output_type")}


def budgets(folder, denoiser: str, extra) -> dict:
    """Each GPU: the runtime overhead, the largest activation and half the denoiser's weights. The denoiser
    (more than either GPU holds beside its activations) cannot stay whole on one, and split whole over both it
    leaves no room for the others: it keeps what both GPUs' phases leave and streams the rest."""
    plan = Pipeline.plan_placement(folder, max_memory=ROOMY, call=planned_call(extra))
    transient = max(component.activation_bytes or 0 for component in plan.components.values())
    budget = ACCELERATOR_RUNTIME_OVERHEAD + transient + plan.components[denoiser].bytes // 2
    return {0: f"{budget}B", 1: f"{budget}B", "cpu": "4GiB"}  # exact bytes: tiny models, tiny budgets


def weights_on(pipe) -> dict:
    """Bytes of the pipeline's weights on each accelerator now."""
    found: dict = {}
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for tensor in [*component.parameters(), *component.buffers()]:
                if tensor.device.type != "cpu" and not tensor.is_meta:
                    found[tensor.device.index] = found.get(tensor.device.index, 0) + tensor.numel() * tensor.element_size()
    return found


def planned_onto(plan) -> dict:
    """Host -> GPU bytes per call the plan sends onto each GPU: a component's moved bytes go to its execution
    device (these plans load nothing per call onto another GPU)."""
    found: dict = {}
    for component in plan.components.values():
        transfer = component.transfer
        if transfer is not None and transfer.bytes_per_call:
            assert not transfer.per_call_devices
            found[component.execution_device] = found.get(component.execution_device, 0) + transfer.bytes_per_call
    return found


def run(pipe, extra):
    with torch.no_grad():
        return pipe(**inputs(extra)).images.cpu()


@pytest.mark.parametrize("build", [flux, unet], ids=["dit", "unet"])
def test_the_denoiser_keeps_blocks_on_both_gpus_streams_the_rest_and_computes_the_plain_run(monkeypatch, tmp_path,
                                                                                         build):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    torch.manual_seed(0)
    built, denoiser, extra = build(tmp_path / "parts")
    built.save_pretrained(tmp_path / "pipe")
    expected = run(diffusers.DiffusionPipeline.from_pretrained(tmp_path / "pipe"), extra)
    pipe = Pipeline.from_pretrained(tmp_path / "pipe", device_map="balanced", call=planned_call(extra),
                                    max_memory=budgets(tmp_path / "pipe", denoiser, extra), progress=False)
    plan = pipe.placement_plan
    placed = plan.components[denoiser]
    transfer = placed.transfer
    # Pooled: resident blocks on both GPUs, each running its span, the rest streamed at every step.
    assert is_accelerator(placed.execution_device) and transfer.runs_per_call == STEPS
    assert placed.placed_bytes.get(0, 0) > 0 and placed.placed_bytes.get(1, 0) > 0
    assert transfer.streamed_per_run_bytes > 0 and placed.placed_bytes.get("cpu", 0) > 0
    assert {device for device in placed.device_map.values()} == {0, 1, "cpu"}
    assert all(component.execution_device != "cpu" for component in plan.components.values())
    assert "streams" in plan.explain() and set(pipe.hf_device_map.values()) >= {0, 1}

    seen: dict = {}  # the most weight bytes each GPU held while a denoiser block ran

    def record(*_):
        for device, size in weights_on(pipe).items():
            seen[device] = max(seen.get(device, 0), size)
    blocks = [module for path, module in getattr(pipe, denoiser).named_modules() if path in placed.device_map]
    handles = [block.register_forward_hook(record) for block in blocks]
    assert_same_output(run(pipe, extra), expected)  # the first call also loads what steady state keeps
    with measure_transfers() as meter:
        second = run(pipe, extra)
    assert_same_output(second, expected)
    assert meter.weights.host_to_accelerator_bytes == plan.transfer_bytes_per_call  # to the byte
    assert meter.weights.accelerator_to_accelerator_bytes == 0  # weights never hop between GPUs
    assert meter.onto(Payload.WEIGHTS) == planned_onto(plan)  # each GPU's link carries what the plan sends it
    assert meter.inputs.accelerator_to_accelerator_bytes > 0  # activations cross at the span boundaries
    for handle in handles:
        handle.remove()
    assert set(seen) == {0, 1}  # both GPUs held the denoiser's blocks while it ran
    for device in plan.devices:
        if is_accelerator(device.device):  # weights and blocks in flight within what the plan predicts there
            assert seen.get(device.device, 0) <= device.predicted_peak - device.overhead
    pipe.reset_device_map()
    assert_same_output(run(pipe, extra), expected)


def onto_each_gpu(plan, pipe) -> dict:
    """Host -> GPU bytes per call the plan sends onto each GPU: a block streamed onto another GPU
    (`streamed_devices`) at every run onto that GPU, everything else a component moves onto its execution device."""
    found: dict = {}
    for name, component in plan.components.items():
        transfer = component.transfer
        if transfer is None or not transfer.bytes_per_call:
            continue
        module = getattr(pipe, name)
        away = 0
        for path, device in transfer.streamed_devices.items():
            size = sum(t.numel() * t.element_size() for t in module.get_submodule(path).state_dict().values())
            found[device] = found.get(device, 0) + transfer.runs_per_call * size
            away += transfer.runs_per_call * size
        home = component.execution_device
        found[home] = found.get(home, 0) + transfer.bytes_per_call - away
    return found


def test_the_planner_streams_over_both_gpus_links_and_the_call_computes_the_plain_run(monkeypatch, tmp_path):
    # A host link slow enough (1 MB/s) that a tiny DiT's copies bound the call by seconds, not microseconds (the
    # search rounds exposed seconds to the microsecond): the library's own plan streams every other streamed block
    # onto the second GPU through its own link and buffer (issue 39), and runs as the plain run.
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setattr(planner, "_search_link", lambda *_: 1e6)
    torch.manual_seed(0)
    built, denoiser, extra = flux(tmp_path / "parts")
    built.save_pretrained(tmp_path / "pipe")
    expected = run(diffusers.DiffusionPipeline.from_pretrained(tmp_path / "pipe"), extra)
    pipe = Pipeline.from_pretrained(tmp_path / "pipe", device_map="balanced", call=planned_call(extra),
                                    max_memory=budgets(tmp_path / "pipe", denoiser, extra), progress=False)
    plan = pipe.placement_plan
    transfer = plan.components[denoiser].transfer
    home = plan.components[denoiser].execution_device
    assert transfer.streamed_devices and home not in set(transfer.streamed_devices.values())
    assert list(transfer.streamed_devices) == transfer.streamed_modules[1::2]
    assert_same_output(run(pipe, extra), expected)  # the first call also loads what steady state keeps
    with measure_transfers() as meter:
        second = run(pipe, extra)
    assert_same_output(second, expected)
    assert meter.weights.host_to_accelerator_bytes == plan.transfer_bytes_per_call  # to the byte
    assert meter.weights.accelerator_to_accelerator_bytes == 0  # weights never hop between GPUs
    assert meter.onto(Payload.WEIGHTS) == onto_each_gpu(plan, pipe)  # each GPU's link carries its own blocks
    pipe.reset_device_map()
    assert_same_output(run(pipe, extra), expected)

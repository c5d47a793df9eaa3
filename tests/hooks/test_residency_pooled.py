"""Pooled residency at runtime (issue 39): a denoiser whose blocks are resident on two GPUs, each GPU running its
span, and whose host-homed blocks stream onto the GPU whose span they sit in, through that GPU's own stream buffers
(`ComponentTransfer.streamed_devices`). On strict virtual accelerators: the plain run's output, the plan's bytes to
the byte, each GPU's link carrying its own blocks, activations crossing only at the span boundaries."""

import pytest
import torch

from hooks import Technique, OffloadConfigError, apply_plan, measure_transfers, techniques_on
from hooks.residency import ResidencyConfig, apply_residency
from hooks.transfer_meter import Payload
from placement.devices import torch_device
from transfer_pipeline import STEPS, assert_decoded, component, make, nbytes, place_resident, plan, run
from same_output import assert_same_output

# GPU 0's span: proj_in, blocks 0-2 (1 streamed onto GPU 0); GPU 1's span: blocks 3-5 (4 streamed onto GPU 1).
DENOISER_MAP = {"proj_in": 0, "blocks.0": 0, "blocks.1": "cpu", "blocks.2": 0, "blocks.3": 1, "blocks.4": "cpu",
                "blocks.5": 1, "norm": 0, "proj_out": 0}
STREAMED = ("blocks.1", "blocks.4")
ONTO_GPU_1 = {"blocks.4": 1}


@pytest.fixture(autouse=True)
def two_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


def pooled_plan(modules):
    denoiser = component("denoiser", modules["denoiser"], DENOISER_MAP, streamed=STREAMED, runs=STEPS)
    denoiser = denoiser.model_copy(update={
        "transfer": denoiser.transfer.model_copy(update={"streamed_devices": ONTO_GPU_1})})
    components = [component("encoder", modules["encoder"], {"": 0}),
                  denoiser, component("decoder", modules["decoder"], {"": 0})]
    resident = [sum(c.placed_bytes.get(gpu, 0) for c in components) for gpu in (0, 1)]
    block = nbytes(modules["denoiser"], ("blocks.1",))
    return plan(components, {0: resident[0] + 2 * block + 4000, 1: resident[1] + 2 * block + 4000})


def test_each_gpu_streams_its_own_span_and_the_call_computes_the_plain_run():
    modules = make()
    expected = run(modules)
    placement = pooled_plan(modules)
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    denoiser = modules["denoiser"]
    where: dict[str, set] = {}  # the device each streamed block's weights are on while it runs
    for path in STREAMED:
        inner = denoiser.get_submodule(f"{path}.attn")  # runs inside the block, once its group is on its GPU
        inner.register_forward_pre_hook(lambda m, _, path=path: where.setdefault(path, set()).add(m.weight.device))
    first = denoiser.blocks[0].attn  # GPU 0's span starts: GPU 1's first streamed block is already on its way
    first.register_forward_pre_hook(lambda *_: where.setdefault("blocks.4 at the run's start", set()).add(
        denoiser.blocks[4].attn.weight.device))
    run(modules)  # the first call traces the prefetch order
    where.clear()
    with measure_transfers() as meter:
        output = run(modules)
    assert_decoded(output, expected)
    streamed = {path: nbytes(denoiser, (path,)) for path in STREAMED}
    assert meter.weights.host_to_accelerator_bytes == placement.transfer_bytes_per_call == STEPS * sum(streamed.values())
    assert meter.onto(Payload.WEIGHTS) == {0: STEPS * streamed["blocks.1"], 1: STEPS * streamed["blocks.4"]}
    assert meter.weights.accelerator_to_accelerator_bytes == 0
    assert where == {"blocks.1": {torch_device(0)}, "blocks.4": {torch_device(1)},
                     "blocks.4 at the run's start": {torch_device(1)}}  # each GPU prefetches its own chain
    # Per step, h crosses once each way at GPU 1's span; cond goes to GPU 1 for each of its three blocks.
    assert meter.inputs.accelerator_to_accelerator_bytes == STEPS * (2 + 3) * 32 * 4
    assert denoiser.blocks[4].attn.weight.device.type == "cpu"  # streamed: back on the host between runs
    on_1 = placed.context.shared[(Technique.PER_CALL_RESIDENCY, 1)]
    share = next(share for share in on_1.phases if share.phase.place == 0)
    assert share.transient_bytes == streamed["blocks.4"]  # GPU 1 holds its own stream buffer, no activations
    placed.remove()
    assert all(techniques_on(module) == {} for module in modules.values())
    for module in modules.values():
        module.to("cpu")
    assert_same_output(run(modules), expected)


def test_streamed_devices_must_name_streamed_modules_and_accelerators():
    modules = make()
    denoiser = modules["denoiser"]
    for module in (denoiser.proj_in, denoiser.blocks[0], denoiser.blocks[2], denoiser.norm, denoiser.proj_out):
        module.to(torch_device(0))
    for index in (3, 5):
        denoiser.blocks[index].to(torch_device(1))
    for wrong in ({"blocks.3": 1}, {"blocks.4": "cpu"}):
        config = ResidencyConfig(execution_device=0, device_map=DENOISER_MAP, streamed_modules=STREAMED,
                                 streamed_devices=wrong)
        with pytest.raises(OffloadConfigError, match="streamed_devices"):
            apply_residency(denoiser, config)
        assert techniques_on(denoiser) == {}

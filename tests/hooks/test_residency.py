"""Per-call residency on virtual accelerators: a whole pipeline placed by hand-built transfer plans moves, on
its second call, exactly what the plan says (`sum(transfer.bytes_per_call)`), and computes what the plain run
computes."""

import pytest
import safetensors.torch
import torch

from hooks import (
    GroupOffloadHook,
    Technique,
    OffloadConfigError,
    apply_plan,
    measure_transfers,
    techniques_on,
    undispatch,
)
from hooks.hook_utils import find_hooks, hooks_of
from hooks.input_moving import MoveInputsHook
from hooks.residency import ResidencyHook, StreamedBlockHook
from placement.devices import torch_device
from transfer_pipeline import STEPS, assert_decoded, caller_inputs, component, make, nbytes, place_resident, plan, run
from same_output import assert_same_output

ROOM = 9000  # bytes for per-call blocks, activations and stream buffers on GPU 0 (beside resident weights)
DENOISER_MAP = {"proj_in": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": "cpu", "blocks.3": "cpu",
                "blocks.4": "cpu", "blocks.5": "cpu", "norm": 0, "proj_out": 0}
DECODER = dict(per_call=("post", "out"), streamed=("up",), activation_bytes=4000)  # a decode needing room


@pytest.fixture
def gpus(monkeypatch):
    def set_count(count: int) -> None:
        monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", str(count))

    return set_count


def one_gpu_plan(modules, *, decoder_map=None):
    components = [
        component("encoder", modules["encoder"], {"": "cpu"}, per_call=("",)),
        component("denoiser", modules["denoiser"], DENOISER_MAP, per_call=("blocks.2", "blocks.3"),
                  streamed=("blocks.4", "blocks.5"), runs=STEPS),
        component("decoder", modules["decoder"], decoder_map or {"": "cpu"}, **DECODER),
    ]
    resident = sum(c.placed_bytes.get(0, 0) for c in components)
    return plan(components, {0: resident + ROOM})


def planned_bytes(placement) -> int:
    return sum(c.transfer.bytes_per_call for c in placement.components.values() if c.transfer is not None)


def second_call(modules):
    run(modules)  # the first call loads what steady state keeps
    with measure_transfers() as meter:
        output = run(modules)
    return output, meter


def assert_runs_again_on_the_cpu(modules, expected) -> None:
    """After removal the modules are plain again: moved to the CPU (what `reset_device_map` does next: resident
    weights stay on their accelerator until then), they compute what they computed before placement."""
    for module in modules.values():
        module.to("cpu")
    assert_same_output(run(modules), expected)


def test_the_second_call_moves_exactly_the_plans_bytes_per_call(gpus):
    gpus(1)
    modules = make()
    expected = run(modules)
    placement = one_gpu_plan(modules)
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    output, meter = second_call(modules)
    assert_decoded(output, expected)
    # 2752 (encoder per call) + 4352 + 4 x 4352 (denoiser per call, streamed) + 1292 + 2176 (decoder) = 27980
    assert meter.weights.host_to_accelerator_bytes == planned_bytes(placement) == 27980
    assert meter.weights.accelerator_to_accelerator_bytes == 0
    # Inputs apart: x in, each step latents and cond in and the output back, the decoder's latents in.
    floats = 4
    assert meter.inputs.host_to_accelerator_bytes == (12 + STEPS * 64 + 32) * floats
    assert meter.inputs.accelerator_to_host_bytes == (32 + STEPS * 32) * floats
    assert meter.host_to_accelerator_bytes == 27980 + (12 + STEPS * 64 + 32) * floats
    placed.remove()
    assert all(techniques_on(module) == {} for module in modules.values())
    resident, per_call = modules["denoiser"].proj_in.weight, modules["denoiser"].blocks[2].attn.weight
    assert resident.device == torch_device(0) and per_call.device.type == "cpu"  # each where the loader put it
    assert_runs_again_on_the_cpu(modules, expected)


def test_per_call_blocks_are_released_only_when_another_phase_needs_the_room(gpus):
    gpus(1)
    modules = make()
    placement = one_gpu_plan(modules)
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    run(modules)
    phases = {name: handle.state for name, handle in placed.handles.items()}
    # After a call: the decode (4000 bytes of activations) needed the denoiser's per-call blocks' room; the
    # encoder's went when the denoiser started; the decoder's own stay until the next denoiser phase.
    assert phases["denoiser"].loaded_bytes == 0 and phases["encoder"].loaded_bytes == 0
    assert phases["decoder"].loaded_bytes == nbytes(modules["decoder"], ("post", "out"))
    with torch.no_grad():
        modules["encoder"](caller_inputs())  # the encoder's phase: the decoder's 1292 bytes fit beside it
    assert phases["decoder"].loaded_bytes > 0 and phases["encoder"].loaded_bytes == nbytes(modules["encoder"])
    coordinator = placed.context.shared[(Technique.PER_CALL_RESIDENCY, 0)]
    assert coordinator.room == ROOM and [p.name for p in coordinator.phases] == ["Encoder", "Denoiser", "Decoder"]
    placed.remove()


def test_one_hook_per_component_boundary_and_group_hooks_on_streamed_blocks_only(gpus):
    gpus(1)
    modules = make()
    placement = one_gpu_plan(modules)
    place_resident(modules, placement)
    apply_plan(modules, placement)
    denoiser = modules["denoiser"]
    hooked = {name for name, sub in denoiser.named_modules() if hooks_of(sub)}
    assert hooked == {"", "blocks.4", "blocks.5"}
    assert [type(h) for h in hooks_of(denoiser)] == [ResidencyHook]
    assert {name for name, _, _ in find_hooks(denoiser, StreamedBlockHook)} == {"blocks.4", "blocks.5"}
    assert {name for name, sub in modules["encoder"].named_modules() if hooks_of(sub)} == {""}
    assert denoiser.hf_device_map == DENOISER_MAP
    for module in modules.values():
        undispatch(module)  # what reset_device_map does: every hook off, weights back as the loader left them
        assert techniques_on(module) == {}
    assert denoiser.blocks[2].attn.weight.device.type == "cpu" and not denoiser.blocks[2].attn.weight.is_pinned()


def test_two_gpus_split_resident_part_and_per_call_swaps(gpus):
    gpus(2)
    modules = make()
    expected = run(modules)
    denoiser_map = {**DENOISER_MAP, "blocks.0": 1, "blocks.1": 1}
    components = [
        component("encoder", modules["encoder"], {"": 1}, execution=1),  # resident on GPU 1: a device map
        component("denoiser", modules["denoiser"], denoiser_map, per_call=("blocks.2", "blocks.3"),
                  streamed=("blocks.4", "blocks.5"), runs=STEPS, kind=None),
        component("decoder", modules["decoder"], {"": "cpu"}, **DECODER),
    ]
    resident = sum(c.placed_bytes.get(0, 0) for c in components)
    placement = plan(components, {0: resident + ROOM, 1: 10**6})
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    assert placed.handles["encoder"].technique is Technique.DEVICE_MAP
    assert {name for name, _, _ in find_hooks(modules["denoiser"], MoveInputsHook)} >= {"", "blocks.0", "blocks.2"}
    output, meter = second_call(modules)
    assert_decoded(output, expected)
    assert meter.weights.host_to_accelerator_bytes == planned_bytes(placement) == 27980 - 2752
    # Per step: h to GPU 1 (blocks.0) and back (blocks.2); cond to GPU 1 for each of blocks.0 and blocks.1.
    assert meter.inputs.accelerator_to_accelerator_bytes == STEPS * 4 * 32 * 4
    placed.remove()


def test_per_call_blocks_loaded_onto_another_gpu_where_its_phase_has_room(gpus):
    gpus(2)
    modules = make()
    expected = run(modules)
    away = ("blocks.3",)  # loaded per call onto GPU 1 (GPU 0 lacks the room), released for the encoder's phase
    components = [
        component("encoder", modules["encoder"], {"": 1}, execution=1, activation_bytes=3000),
        component("denoiser", modules["denoiser"], DENOISER_MAP, per_call=("blocks.2", *away),
                  streamed=("blocks.4", "blocks.5"), runs=STEPS),
        component("decoder", modules["decoder"], {"": "cpu"}, **DECODER),
    ]
    denoiser = components[1]
    components[1] = denoiser.model_copy(update={
        "transfer": denoiser.transfer.model_copy(update={"per_call_devices": {"blocks.3": 1}})})
    resident = [sum(c.placed_bytes.get(gpu, 0) for c in components) for gpu in (0, 1)]
    # GPU 0: the decoder's phase (7468 bytes) fits, the denoiser's (6528) beside the decoder's per-call 1292 not.
    placement = plan(components, {0: resident[0] + 7600, 1: resident[1] + 3000})
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    output, meter = second_call(modules)
    assert_decoded(output, expected)
    assert meter.weights.host_to_accelerator_bytes == planned_bytes(placement) == 27980 - 2752  # encoder resident
    assert meter.weights.accelerator_to_accelerator_bytes == 0
    assert meter.inputs.accelerator_to_accelerator_bytes > 0  # h hops to GPU 1 for blocks.3 and back
    blocks = modules["denoiser"].blocks
    with torch.no_grad():
        modules["denoiser"](torch.zeros(2, 16), torch.zeros(2, 16))
    assert blocks[3].attn.weight.device == torch_device(1) and blocks[2].attn.weight.device == torch_device(0)
    on_1 = placed.context.shared[(Technique.PER_CALL_RESIDENCY, 1)]
    assert [share.name for share in on_1.phases] == ["Encoder", "Denoiser"]
    assert on_1.phases[1].per_call_bytes == nbytes(modules["denoiser"], away)
    with torch.no_grad():
        modules["encoder"](caller_inputs())  # its activations need GPU 1's room: blocks.3 goes back
    assert blocks[3].attn.weight.device.type == "cpu"
    placed.remove()
    assert_runs_again_on_the_cpu(modules, expected)


def test_disk_homed_modules_load_per_call_and_stream_from_the_checkpoint_files(gpus, tmp_path):
    gpus(1)
    modules = make()
    expected = run(modules)
    decoder = modules["decoder"]
    file = tmp_path / "decoder.safetensors"
    safetensors.torch.save_file(decoder.state_dict(), file)
    index = {name: {"safetensors_file": str(file), "weight_name": name, "dtype": "float32"}
             for name in decoder.state_dict()}
    placement = one_gpu_plan(modules, decoder_map={"": "disk"})
    decoder.to("meta")  # what the loader leaves for "disk" parameters
    place_resident(modules, placement)
    placed = apply_plan(modules, placement, disk_weights={"decoder": index})
    output, meter = second_call(modules)
    assert_decoded(output, expected)
    assert meter.weights.host_to_accelerator_bytes == planned_bytes(placement) == 27980
    # Between uses the module holds placeholders, the bytes stay in the file: streamed blocks after each run,
    # per-call blocks once another phase needed the room (the decoder's stay loaded until the denoiser's).
    assert decoder.up[0].weight.is_meta and not decoder.post.weight.is_meta
    with torch.no_grad():
        modules["denoiser"](torch.zeros(2, 16), torch.zeros(2, 16))
    assert decoder.post.weight.is_meta
    placed.remove()
    assert decoder.post.weight.device.type == "cpu"  # removal reads them back, as undispatch does for disk
    assert_runs_again_on_the_cpu(modules, expected)


def test_plans_without_transfer_models_run_as_before(gpus):
    gpus(1)
    modules = make()
    expected = run(modules)
    components = [component("encoder", modules["encoder"], {"": 0}, transfer=False),
                  component("denoiser", modules["denoiser"], {"": "cpu"}, runs=STEPS, transfer=False),
                  component("decoder", modules["decoder"], {"": 0}, transfer=False)]
    placement = plan(components, {0: 10**6})
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    assert [h.technique for h in placed.handles.values()] == [Technique.DEVICE_MAP, Technique.GROUP_OFFLOAD,
                                                              Technique.DEVICE_MAP]
    assert list(find_hooks(modules["denoiser"], GroupOffloadHook)) != []
    output, meter = second_call(modules)
    assert_decoded(output, expected)
    assert meter.weights.host_to_accelerator_bytes == STEPS * nbytes(modules["denoiser"])  # streamed at every step
    placed.remove()


def test_a_transfer_plan_that_does_not_cover_the_host_homed_modules_is_refused_and_leaves_nothing(gpus):
    gpus(1)
    modules = make()
    components = [component("encoder", modules["encoder"], {"": "cpu"}, per_call=("layers",)),  # embed, norm?
                  component("denoiser", modules["denoiser"], {"": 0}),
                  component("decoder", modules["decoder"], {"": 0})]
    with pytest.raises(OffloadConfigError, match=r"Encoder: 4 tensor\(s\) are homed on the host but in neither"):
        apply_plan(modules, plan(components, {0: 10**6}))
    assert all(techniques_on(module) == {} for module in modules.values())
    bad = [component("encoder", modules["encoder"], {"": "cpu"}, per_call=("",), streamed=("layers.0",)),
           *components[1:]]
    with pytest.raises(OffloadConfigError, match="listed twice"):
        apply_plan(modules, plan(bad, {0: 10**6}))
    resident = [component("encoder", modules["encoder"], {"": 0}, per_call=("layers",)), *components[1:]]
    with pytest.raises(OffloadConfigError, match="resident"):
        apply_plan(modules, plan(resident, {0: 10**6}))
    assert all(techniques_on(module) == {} for module in modules.values())


@pytest.mark.gpu
def test_on_cuda_per_call_blocks_come_from_pinned_memory_and_the_meter_agrees(monkeypatch):
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)
    modules = make()
    expected = run(modules)
    placement = one_gpu_plan(modules)
    place_resident(modules, placement)
    placed = apply_plan(modules, placement)
    output, meter = second_call(modules)
    assert output.device == torch_device(0)
    torch.testing.assert_close(output.cpu(), expected, atol=1e-5, rtol=1e-4)  # CUDA's kernels against the CPU's
    assert meter.weights.host_to_accelerator_bytes == planned_bytes(placement) == 27980
    denoiser, decoder = modules["denoiser"], modules["decoder"]
    assert decoder.post.weight.device.type == "cuda"  # the decoder's per-call blocks stay until room is needed
    assert denoiser.blocks[2].attn.weight.device.type == "cpu" and denoiser.blocks[2].attn.weight.is_pinned()
    assert denoiser.blocks[4].attn.weight.is_pinned()  # streamed: back in pinned host memory after each run
    assert denoiser.proj_in.weight.device.type == "cuda"
    placed.remove()
    assert not denoiser.blocks[2].attn.weight.is_pinned()

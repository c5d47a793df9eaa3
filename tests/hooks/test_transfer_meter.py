"""The transfer meter counts what each technique's semantics say it moves per call, on virtual accelerators
(CPU-backed: no byte moves, every copy to an accelerator is counted as on a GPU).

Steady state (the second call) of encoder -> denoiser x STEPS -> decoder, weights host -> accelerator:
model offload: every component once; group and sequential offload: every component at every run."""

import pytest
import safetensors.torch
import torch
from torch import nn

from hooks import (
    TECHNIQUES,
    GroupOffloadingConfig,
    ModelOffloadConfig,
    SequentialOffloadConfig,
    Technique,
    Traffic,
    apply_model_cpu_offload,
    apply_to_each,
    dispatch,
    measure_transfers,
    undispatch,
)
from hooks.transfer_meter import Direction, direction
from placement.devices import strict_virtual_accelerators, torch_device
from transfer_pipeline import STEPS, assert_decoded, make, nbytes, place_entries, run
from same_output import assert_same_output


@pytest.fixture(autouse=True)
def one_virtual_gpu(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")


def second_call(modules, *, caller=None):
    """The meter of the second call, made by a caller whose tensors are on `caller` (None: the host; model and
    group offloading leave outputs on the execution device, so their caller works there, as diffusers' does)."""
    expected = run(make())
    device = None if caller is None else torch_device(caller)
    run(modules, device=device)
    with measure_transfers() as meter:
        output = run(modules, device=device)
    assert_decoded(output, expected)
    return meter


def runs_times_weights(modules) -> int:
    return sum(nbytes(module) * (STEPS if name == "denoiser" else 1) for name, module in modules.items())


def test_model_offload_moves_every_component_once_per_call():
    modules = make()
    chain = apply_model_cpu_offload(list(modules.values()), ModelOffloadConfig(execution_device=0))
    meter = second_call(modules, caller=0)
    # 2752 + 15360 + 3468: the ring sends the decoder back when the encoder starts the next call
    assert meter.weights.host_to_accelerator_bytes == sum(nbytes(m) for m in modules.values()) == 21580
    chain.offload_all()
    with measure_transfers() as meter:
        run(modules, device=torch_device(0))
    assert meter.weights.host_to_accelerator_bytes == 21580
    chain.remove()


@pytest.mark.parametrize("technique, config", [  # made under the virtual accelerator, where 0 is the CPU
    (Technique.GROUP_OFFLOAD, lambda: GroupOffloadingConfig(onload_device=0)),
    (Technique.GROUP_OFFLOAD, lambda: GroupOffloadingConfig(onload_device=0, offload_type="leaf_level")),
    (Technique.SEQUENTIAL_OFFLOAD, lambda: SequentialOffloadConfig(execution_device=0)),
])
def test_group_and_sequential_offload_move_every_component_at_every_run(technique, config):
    modules = make()
    handles = apply_to_each(technique, modules, lambda name: config())
    meter = second_call(modules, caller=0)
    # 2752 + 4 x 15360 + 3468; the decoder, entered through decode, loads its rest group once per call
    assert meter.weights.host_to_accelerator_bytes == runs_times_weights(modules) == 67660
    assert meter.weights.accelerator_to_accelerator_bytes == 0
    for handle in handles.values():
        handle.remove()


def test_a_device_map_streams_its_cpu_and_disk_entries_at_every_run(tmp_path):
    modules = make()
    denoiser, decoder = modules["denoiser"], modules["decoder"]
    file = tmp_path / "decoder.safetensors"
    safetensors.torch.save_file(decoder.state_dict(), file)
    index = {name: {"safetensors_file": str(file), "weight_name": name, "dtype": "float32"}
             for name in decoder.state_dict()}
    decoder.to("meta")
    denoiser_map = {"proj_in": 0, "blocks": "cpu", "norm": 0, "proj_out": 0}
    place_entries(modules["encoder"], {"": 0})  # the loader's part: weights on the accelerators their map names
    place_entries(denoiser, denoiser_map)
    dispatch(modules["encoder"], {"": 0})
    dispatch(denoiser, denoiser_map, execution_device=0)
    dispatch(decoder, {"": "disk"}, execution_device=0, disk_weights=index)
    meter = second_call(modules)
    assert meter.weights.host_to_accelerator_bytes == STEPS * nbytes(denoiser, ("blocks",)) + nbytes(decoder)
    for module in modules.values():
        undispatch(module)


def test_nothing_is_counted_without_a_meter_and_meters_nest():
    modules = make()
    TECHNIQUES[Technique.GROUP_OFFLOAD].apply(modules["decoder"], GroupOffloadingConfig(onload_device=0))
    with measure_transfers() as outer:
        run(modules)
        with measure_transfers() as inner:
            run(modules)
    assert inner.weights.host_to_accelerator_bytes == nbytes(modules["decoder"])
    assert outer.weights.host_to_accelerator_bytes == 2 * nbytes(modules["decoder"])
    weights, inputs = outer.weights, outer.inputs
    assert outer.host_to_accelerator_bytes == weights.host_to_accelerator_bytes + inputs.host_to_accelerator_bytes


def test_onload_to_the_cpu_crosses_no_bus():
    modules = make()
    handles = apply_to_each(Technique.GROUP_OFFLOAD, modules, lambda name: GroupOffloadingConfig(onload_device="cpu"))
    with measure_transfers() as meter:
        run(modules)
    assert meter.host_to_accelerator_bytes == meter.accelerator_to_host_bytes == 0
    for handle in handles.values():
        handle.remove()


def test_directions():
    assert direction("cpu", 0) is direction("disk", 1) is Direction.HOST_TO_ACCELERATOR
    assert direction(0, 1) is Direction.ACCELERATOR_TO_ACCELERATOR and direction(1, 1) is None
    assert direction(0, "cpu") is Direction.ACCELERATOR_TO_HOST and direction("cpu", "cpu") is None


@pytest.fixture
def strict():
    """Tensors say where they are: strict virtual accelerators (`vgpu:k`, the suite's default). Plain-CPU ones
    (--virtual-not-strict) leave the meter to track places itself, approximately (hooks.transfer_meter)."""
    if not strict_virtual_accelerators():
        pytest.skip("exact input counting needs strict virtual accelerators (run without --virtual-not-strict)")


class Lengths(nn.Module):
    """Returns a host tensor beside its output, as `mask.sum(1).cpu()` (lengths for packing) does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x), (x > 0).sum(1).cpu()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, h, lengths):
        return self.proj(h) * lengths[:, None]


def test_inputs_are_counted_from_where_each_tensor_is(strict):
    torch.manual_seed(0)
    first, second = Lengths().eval(), Scaled().eval()
    x = torch.linspace(-1, 1, 32).reshape(2, 16)
    with torch.no_grad():
        expected = second(*first(x))
    chain = apply_model_cpu_offload([first, second], ModelOffloadConfig(execution_device=0))
    with measure_transfers() as meter, torch.no_grad():
        output = second(*first(x.to(torch_device(0))))  # a caller working on the accelerator
    assert_same_output(output.cpu(), expected)
    # Only the lengths cross: made on the host inside a component that ran on GPU 0, they are on the host
    # (two int64), and the second component's hook moves them in. x, h and the output stay on GPU 0.
    assert meter.inputs == Traffic(host_to_accelerator_bytes=2 * 8)
    assert meter.weights.host_to_accelerator_bytes == nbytes(first) + nbytes(second)
    chain.remove()


def test_outputs_already_where_the_caller_is_are_not_counted(strict, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    denoiser = make()["denoiser"]
    expected = denoiser(torch.ones(2, 16), torch.ones(2, 16)).detach()
    denoiser_map = {"proj_in": 0, "blocks": 1, "norm": 1, "proj_out": 1}
    place_entries(denoiser, denoiser_map)
    dispatch(denoiser, denoiser_map, execution_device=0)
    gpu1 = torch_device(1)
    with measure_transfers() as meter, torch.no_grad():
        output = denoiser(torch.ones(2, 16, device=gpu1), torch.ones(2, 16, device=gpu1))
    assert output.device == gpu1  # computed on GPU 1 (proj_out), where the caller is: nothing to move back
    assert_same_output(output.cpu(), expected)
    # latents and cond to GPU 0 at the top; h and cond to GPU 1 at blocks.0, cond again at each later block
    # (the forward keeps its own, on GPU 0); 32 floats each. The output is not counted: it did not move.
    assert meter.inputs.accelerator_to_accelerator_bytes == (2 + 2 + 5) * 32 * 4
    assert meter.inputs.host_to_accelerator_bytes == meter.inputs.accelerator_to_host_bytes == 0
    undispatch(denoiser)

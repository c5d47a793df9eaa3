"""Strict virtual accelerators (PLACEMENT_VIRTUAL_ACCELERATORS=N): each tensor belongs to the virtual device it
was moved to, and an op that mixes two devices raises the error CUDA raises, while every number equals a CPU
run's. These tests pin the tensor-level behaviour; tests/pipelines/test_strict_pipelines.py the library's.

Numbers compare bit for bit here, unlike elsewhere in the suite (tests/same_output.py): this is the backend's own
promise (the same aten op on the same CPU tensors, strides and flags), on operands allocated alike."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import load_file, save_file
from torch import nn

from placement.devices import normalize_device, torch_device
from placement.virtual import VirtualTensor

MIXED = "Expected all tensors to be on the same device, but found at least two devices"


@pytest.fixture(autouse=True)
def two_strict_virtual_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")


def gpu(index: int) -> torch.device:
    return torch_device(index)


def test_a_module_on_virtual_1_fed_an_input_on_virtual_0_raises_as_cuda_does():
    linear = nn.Linear(4, 2).to(gpu(1))
    with pytest.raises(RuntimeError, match=f"{MIXED}, vgpu:1 and vgpu:0!"):
        linear(torch.randn(3, 4, device=gpu(0)))
    with pytest.raises(RuntimeError, match=f"{MIXED}, vgpu:1 and cpu!"):
        linear(torch.randn(3, 4))  # a CPU input left behind
    assert linear(torch.randn(3, 4, device=gpu(1))).device == gpu(1)


def test_cpu_scalars_and_cpu_indices_mix_as_cuda_allows():
    x = torch.arange(6.0).reshape(2, 3).to(gpu(0))
    assert (x * torch.tensor(2.0)).device == gpu(0)  # a 0-dim CPU tensor is a scalar
    assert x[torch.tensor([1, 0])].device == gpu(0)  # indexing with CPU indices
    with pytest.raises(RuntimeError, match=MIXED):
        x + torch.ones(3)  # a 1-dim CPU tensor is not
    with pytest.raises(RuntimeError, match=MIXED):
        torch.cat([x, x.to(gpu(1))])


def test_tensor_device_names_the_virtual_device_and_code_that_follows_it_works():
    weight = torch.randn(4, 4).to(gpu(1))
    assert isinstance(weight, VirtualTensor) and weight.device == torch.device("vgpu", 1)
    assert normalize_device(weight.device) == 1
    follower = torch.randn(2, 4).to(weight.device)  # what model code does: x.to(weight.device)
    made_there = torch.zeros(2, 4, device=weight.device)  # and diffusers: randn(..., device=pipe.device)
    assert (follower @ weight + made_there).device == gpu(1)
    assert torch.randn(3, device=gpu(0)).device == gpu(0) and torch.tensor([1.0], device=gpu(1)).device == gpu(1)
    back = weight.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"


def test_a_random_op_on_a_virtual_device_refuses_a_cpu_generator_as_cuda_does():
    with pytest.raises(RuntimeError, match="Expected a 'vgpu' device type for generator but found 'cpu'"):
        torch.randn(3, device=gpu(0), generator=torch.Generator().manual_seed(0))


def test_devices_do_not_share_bytes():
    x = torch.zeros(3).to(gpu(0))
    y = x.to(gpu(1))
    y.add_(1)
    assert x.cpu().tolist() == [0.0, 0.0, 0.0] and y.tolist() == [1.0, 1.0, 1.0]
    view = y[:2]
    view.mul_(5)  # a view writes into its base, as on a device
    assert y.tolist() == [5.0, 5.0, 1.0]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = F.silu(self.norm(self.conv(x)))  # (B, 8, H, W)
        tokens = h.flatten(2).transpose(1, 2)  # (B, HW, 8)
        q = k = v = self.proj(tokens).unflatten(-1, (2, 4)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_numbers_equal_a_cpu_run_bit_for_bit(mode):
    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(2, 4, 8, 8)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        expected = block(x)
        # Attention too: its composite kernel would pick the unfused math kernel for a non-CPU device type.
        got = copy.deepcopy(block).to(gpu(1))(x.to(gpu(1)))
    assert got.device == gpu(1) and torch.equal(got.cpu(), expected)


def test_parameters_keep_their_device_through_accelerate_module_to_and_data():
    module = nn.Linear(4, 2, device="meta")
    set_module_tensor_to_device(module, "weight", gpu(1), value=torch.ones(2, 4))  # param_cls(new_value)
    assert isinstance(module.weight, nn.Parameter) and module.weight.device == gpu(1)
    set_module_tensor_to_device(module, "weight", gpu(0))
    assert module.weight.device == gpu(0) and module.weight.tolist() == [[1.0] * 4] * 2
    set_module_tensor_to_device(module, "weight", "cpu", value=module.weight)
    assert type(module.weight) is nn.Parameter and module.weight.device.type == "cpu"
    module = nn.Linear(4, 2).to(gpu(0)).to(gpu(1)).to(torch.float16)
    assert {p.device for p in module.parameters()} == {gpu(1)} and module.weight.dtype == torch.float16
    weight = module.weight
    weight.data = weight.data.to(gpu(0))  # group offloading's way: the same object, on another device
    assert module.weight is weight and weight.device == gpu(0) and weight._inner.dtype == torch.float16
    weight.data = weight.data.cpu()
    assert module.weight is weight and weight.device.type == "cpu" and isinstance(weight, nn.Parameter)


def test_a_cpu_tensor_given_a_virtual_value_through_data_moves_there_as_on_cuda():
    module = nn.Linear(4, 2)
    module.register_buffer("scale", torch.full((2,), 2.0))
    held = module(torch.ones(3, 4)) * module.scale  # an autograd graph saves the buffer: it cannot be swapped
    with pytest.raises(RuntimeError, match=r"`tensor.data = value` from cpu to vgpu:1 swaps the tensor object"):
        module.scale.data = module.scale.data.to(gpu(1))
    del held
    with torch.no_grad():
        expected = module(torch.ones(3, 4)) * module.scale
    weight, bias, scale = module.weight, module.bias, module.scale
    for tensor in (weight, bias, scale):
        tensor.data = tensor.data.to(gpu(1))  # diffusers' group offloading onloads CPU parameters this way
    assert module.weight is weight and module.bias is bias and module.scale is scale  # the same objects
    assert isinstance(weight, nn.Parameter) and weight.requires_grad and not scale.requires_grad
    assert {weight.device, bias.device, scale.device} == {gpu(1)}
    with torch.no_grad():
        got = module(torch.ones(3, 4, device=gpu(1))) * module.scale
    assert got.device == gpu(1) and torch.equal(got.cpu(), expected)
    with pytest.raises(RuntimeError, match=f"{MIXED}, vgpu:1 and cpu!"):
        module(torch.ones(3, 4))  # the strictness stays
    weight.data = weight.data.cpu()  # and back, as the offload does
    assert type(weight) is nn.Parameter and weight.device.type == "cpu" and module.weight is weight
    plain = torch.zeros(2)
    plain.data = torch.ones(2)  # CPU to CPU: torch's own setter
    assert plain.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_diffusers_group_offloading_onloads_to_a_virtual_accelerator(offload_type):
    hooks = pytest.importorskip("diffusers.hooks")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_in = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.register_buffer("scale", torch.full((8,), 0.5))

        def forward(self, x):
            h = self.proj_in(x)
            for block in self.blocks:
                h = torch.tanh(block(h))
            return h * self.scale

    torch.manual_seed(0)
    net, x = Net().eval(), torch.randn(2, 8)
    with torch.no_grad():
        expected = net(x)
    hooks.apply_group_offloading(net, onload_device=gpu(0), offload_type=offload_type,
                                 num_blocks_per_group=1 if offload_type == "block_level" else None)
    with torch.no_grad():
        runs = [net(x.to(gpu(0))) for _ in range(2)]
    assert all(out.device == gpu(0) and torch.equal(out.cpu(), expected) for out in runs)
    assert type(net.blocks[0].weight) is nn.Parameter and net.blocks[0].weight.device.type == "cpu"  # offloaded


def test_state_dict_safetensors_pickle_and_deepcopy_keep_or_drop_the_device(tmp_path):
    module = nn.Linear(4, 2).to(gpu(1))
    save_file(module.state_dict(), tmp_path / "weights.safetensors")  # gathered to the CPU, as from a GPU
    loaded = load_file(tmp_path / "weights.safetensors")
    assert torch.equal(loaded["weight"], module.weight.cpu())
    torch.save(module.state_dict(), tmp_path / "weights.pt")
    assert torch.load(tmp_path / "weights.pt")["weight"].device == gpu(1)
    assert torch.load(tmp_path / "weights.pt", map_location="cpu")["weight"].device.type == "cpu"
    copied = copy.deepcopy(module)
    assert copied.weight.device == gpu(1) and isinstance(copied.weight, nn.Parameter)
    assert torch.equal(copied.weight.cpu(), module.weight.cpu())


def test_what_cuda_refuses_is_refused():
    x = torch.ones(2).to(gpu(0))
    with pytest.raises(TypeError, match="can't convert vgpu:0 device type tensor to numpy"):
        x.numpy()
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        x.pin_memory()
    assert not x.is_pinned()


def test_not_strict_every_virtual_accelerator_is_the_cpu(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "0")
    linear = nn.Linear(4, 2).to(torch_device(1))
    assert torch_device(1) == torch.device("cpu")
    assert linear(torch.randn(3, 4).to(torch_device(0))).device.type == "cpu"  # the mix-up goes unseen


def test_factories_that_size_their_result_late_have_their_length():
    # arange's generic kernel resizes an empty result; meshgrid and index grids (LTX, HunyuanVideo, Lumina 2, Z-Image)
    # are built from it.
    assert torch.arange(7, device=gpu(0)).shape == (7,)
    assert torch.arange(2, 9, device=gpu(1)).tolist() == list(range(2, 9))
    steps = torch.arange(0, 1, 0.25, device=gpu(0), dtype=torch.float16)
    assert steps.device == gpu(0) and steps.dtype == torch.float16 and steps.tolist() == [0.0, 0.25, 0.5, 0.75]
    rows, columns = torch.meshgrid(torch.arange(4, device=gpu(0)), torch.arange(3, device=gpu(0)), indexing="ij")
    assert rows.shape == columns.shape == (4, 3) and rows.device == gpu(0) and columns[2].tolist() == [0, 1, 2]


def test_a_python_list_of_virtual_scalars_becomes_a_tensor_as_on_cuda():
    step = torch.tensor(5.0, device=gpu(0))  # AuraFlow and FLUX inpaint build timesteps this way
    assert torch.tensor([step / 1000]).tolist() == [torch.tensor(0.005).item()]  # the fp32 nearest 0.005
    assert torch.tensor([step]).device.type == "cpu"
    both = torch.tensor([step, step * 2], device=gpu(1))
    assert both.device == gpu(1) and both.tolist() == [5.0, 10.0]
    assert step.item() == 5.0 and float(step) == 5.0 and int(step) == 5


def test_an_out_argument_of_another_size_is_refused_not_left_wrong():
    out = torch.empty(0, device=gpu(0))
    with pytest.raises(RuntimeError, match=r"out= tensor of shape \[0\] on vgpu:0 .* result of shape \[3\]"):
        torch.add(torch.ones(3, device=gpu(0)), 1, out=out)
    exact = torch.empty(3, device=gpu(0))
    torch.add(torch.ones(3, device=gpu(0)), 1, out=exact)
    assert exact.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_module_to_keeps_parameters_and_ties_the_same_objects_as_on_cuda(mode):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.embed_tokens = nn.Embedding(4, 2), nn.Embedding(4, 2)
            self.embed_tokens.weight = self.shared.weight  # T5's tie

    module = Tied()
    weight = module.shared.weight
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        for device in (gpu(0), "cpu", gpu(1)):
            module.to(device)
            assert module.shared.weight is module.embed_tokens.weight is weight  # moved in place, as CUDA does
            assert weight.device == torch.device(device) and isinstance(weight, nn.Parameter)

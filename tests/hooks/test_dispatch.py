"""hooks.dispatch: relative device maps applied with accelerate hooks, disk weights served from safetensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import save_file
from torch import nn

from hooks.errors import OffloadConfigError
from placement.errors import InvalidDeviceError
from hooks.dispatch import dispatch, undispatch
from same_output import assert_same_output


class Scaled(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("scale", torch.rand(width))  # persistent: must survive disk offload

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.scale


class Stack(nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(Scaled(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack_with_disk_layers(tmp_path, disk_layers):
    """A Stack whose `disk_layers` parameters are on meta, served from a safetensors file by an offload index."""
    torch.manual_seed(0)
    reference = Stack().eval()
    model = Stack().eval()
    model.load_state_dict(reference.state_dict())
    on_disk = {
        name: tensor.clone()
        for name, tensor in reference.named_parameters()
        if any(name.startswith(f"layers.{i}.") for i in disk_layers)
    }
    path = tmp_path / "weights.safetensors"
    save_file(on_disk, str(path))
    for name in on_disk:
        set_module_tensor_to_device(model, name, "meta")
    index = {name: {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"} for name in on_disk}
    return reference, model, index


def hooked(module):
    return [name for name, m in module.named_modules() if hasattr(m, "_hf_hook")]


def test_cpu_and_disk_map_runs_like_the_original(tmp_path):
    reference, model, index = stack_with_disk_layers(tmp_path, disk_layers=[1])
    device_map = {"layers.0": "cpu", "layers.1": "disk", "layers.2": "cpu"}
    dispatch(model, device_map, disk_weights=index)
    x = torch.randn(4, 8)
    assert_same_output(model(x), reference(x))
    assert model.layers[1].linear.weight.device.type == "meta"  # not copied into RAM
    assert torch.equal(model.layers[1].scale, reference.layers[1].scale)  # buffer kept
    assert model.hf_device_map == device_map


def test_device_spellings_are_normalised(tmp_path):
    _, model, index = stack_with_disk_layers(tmp_path, disk_layers=[0])
    dispatch(model, {"layers.0": "DISK", "layers.1": torch.device("cpu"), "layers.2": "cpu"}, disk_weights=index)
    assert model.hf_device_map == {"layers.0": "disk", "layers.1": "cpu", "layers.2": "cpu"}


def test_undispatch_removes_every_hook_and_brings_disk_weights_back(tmp_path):
    reference, model, index = stack_with_disk_layers(tmp_path, disk_layers=[0, 2])
    dispatch(model, {"layers.0": "disk", "layers.1": "cpu", "layers.2": "disk"}, disk_weights=index)
    assert hooked(model)
    undispatch(model)
    assert hooked(model) == []
    assert "to" not in model.__dict__  # accelerate's .to() warning wrapper is gone
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.hf_device_map is None
    x = torch.randn(2, 8)
    assert_same_output(model(x), reference(x))
    model.to(torch.float64)  # an ordinary module again


def test_disk_entries_without_weights_to_serve_them(tmp_path):
    _, model, _ = stack_with_disk_layers(tmp_path, disk_layers=[1])
    with pytest.raises(OffloadConfigError, match=r"'layers\.1'.*disk_weights"):
        dispatch(model, {"layers.0": "cpu", "layers.1": "disk", "layers.2": "cpu"})
    assert hooked(model) == []


def test_failed_dispatch_leaves_no_hook():
    model = Stack()
    with pytest.raises(ValueError):
        dispatch(model, {"layers.0": "cpu", "layers.1": "cpu"})  # layers.2 unmapped
    assert hooked(model) == []


def test_execution_device_cannot_be_disk():
    # The one "disk cannot execute" check (placement.devices.check_can_execute), naming the argument.
    with pytest.raises(InvalidDeviceError, match=r"execution_device.*'disk' holds weights but cannot execute"):
        dispatch(Stack(), {"": "cpu"}, execution_device="disk")


@pytest.mark.gpu
def test_split_and_offloaded_on_an_accelerator(tmp_path):
    reference, model, index = stack_with_disk_layers(tmp_path, disk_layers=[2])
    model.layers[0].to("cuda:0")
    dispatch(model, {"layers.0": 0, "layers.1": "cpu", "layers.2": "disk"}, disk_weights=index)
    x = torch.randn(4, 8)
    out = model(x.to("cuda:0"))
    assert out.device == torch.device("cuda:0")
    assert torch.allclose(out.cpu(), reference(x), atol=1e-5)
    assert model.layers[1].linear.weight.device.type == "meta"  # cpu-offloaded: streamed per forward
    undispatch(model)
    assert hooked(model) == []
    assert model.layers[1].linear.weight.device.type == "cpu"
    assert model.layers[2].linear.weight.device.type == "cpu"


def test_nested_keys_are_flattened_longest_prefix_first(tmp_path):
    reference, model, index = stack_with_disk_layers(tmp_path, disk_layers=[1])
    dispatch(model, {"": "cpu", "layers.1": "disk"}, disk_weights=index)
    assert model.hf_device_map == {"layers.0": "cpu", "layers.1": "disk", "layers.2": "cpu"}
    x = torch.randn(2, 8)
    assert_same_output(model(x), reference(x))


class WithOwnTensors(Stack):
    """Tensors held by the model itself, not by a submodule: keys such as "pos" name a tensor, not a module."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8))
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x):
        return super().forward(x + self.pos) + self.shift


def test_keys_naming_a_tensor_are_placed_even_on_disk_and_raise_no_warning(tmp_path):
    """accelerate hooks modules only: it left a top-level parameter planned for "disk" on meta (the forward
    failed) and warned that the key matches no submodule. dispatch places such tensors where they execute."""
    torch.manual_seed(0)
    reference = WithOwnTensors().eval()
    model = WithOwnTensors().eval()
    model.load_state_dict(reference.state_dict())
    path = tmp_path / "pos.safetensors"
    save_file({"pos": reference.pos.detach().clone()}, str(path))
    set_module_tensor_to_device(model, "pos", "meta")
    index = {"pos": {"safetensors_file": str(path), "weight_name": "pos", "dtype": "float32"}}
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch(model, {"pos": "disk", "shift": "disk", "layers": "cpu"}, disk_weights=index)
    assert model.pos.device.type == "cpu" and model.hf_device_map == {"pos": "cpu", "shift": "cpu", "layers": "cpu"}
    assert_same_output(model(x), reference(x))
    undispatch(model)
    assert hooked(model) == []


@pytest.mark.parametrize("home", ["disk", "cpu"])
def test_a_whole_component_streamed_serves_the_tensors_held_by_its_root(home, tmp_path, monkeypatch):
    """Z-Image's transformer holds `x_pad_token` itself: served from the "" entry, its weights-map name has no
    prefix (it was looked up as '.x_pad_token', a KeyError at the first call)."""
    torch.manual_seed(0)
    reference = WithOwnTensors().eval()
    model = WithOwnTensors().eval()
    model.load_state_dict(reference.state_dict())
    index = None
    if home == "disk":
        path = tmp_path / "model.safetensors"
        save_file({name: tensor.detach().clone() for name, tensor in reference.state_dict().items()}, str(path))
        index = {name: {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"}
                 for name in reference.state_dict()}
        for name, _ in reference.named_parameters():
            set_module_tensor_to_device(model, name, "meta")  # as the loader leaves disk parameters (buffers load)
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    dispatch(model, {"": home}, execution_device=0, disk_weights=index)
    x = torch.randn(2, 8)
    assert_same_output(model(x), reference(x))
    undispatch(model)
    assert hooked(model) == [] and not [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    assert_same_output(model(x), reference(x))


def test_a_key_naming_neither_module_nor_tensor_is_refused_before_any_hook():
    model = WithOwnTensors()
    with pytest.raises(OffloadConfigError, match=r"\['layers.9'\] name neither a submodule nor a tensor.*'layers'"):
        dispatch(model, {"": "cpu", "layers.9": "cpu"})
    assert hooked(model) == []

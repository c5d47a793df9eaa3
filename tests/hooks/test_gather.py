"""hooks.gather: a placed module's weights read from where each technique keeps them (an offloading hook's CPU
state dict or offload index, a group's disk file, the checkpoint files of a per-call residency), into CPU memory,
without moving anything: the hooks, the placeholders and the transfer meter are as they were."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import OffloadedWeightsLoader
from safetensors.torch import save_file
from torch import nn

from hooks import (
    GroupOffloadingConfig, ResidencyConfig, apply_group_offloading, apply_residency, apply_sequential_cpu_offload,
    dispatch, measure_transfers,
)
from hooks.gather import offloaded_weights, offloaded_weights_in_state_dict, read_into_memory, unserved_placeholders
from placement.devices import torch_device
from transfer_pipeline import Denoiser


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")


def denoiser() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = Denoiser().eval()
    return module, {name: tensor.clone() for name, tensor in module.state_dict().items()}


def checkpoint_index(module: nn.Module, tmp_path, under: tuple[str, ...]) -> dict:
    """An offload index over a safetensors file holding the weights of `under`; those go to meta, as the loader
    leaves "disk" parameters."""
    names = [name for name, _ in module.named_parameters() if name.startswith(under)]
    path = tmp_path / "checkpoint.safetensors"
    save_file({name: module.get_parameter(name).detach().clone() for name in names}, str(path))
    for name in names:
        owner, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(owner), attribute, nn.Parameter(torch.empty_like(module.get_parameter(name),
                                                                                     device="meta")))
    return {name: {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"} for name in names}


def placement_of(module: nn.Module) -> dict[str, str]:
    state = {key: str(t.device) for key, t in [*module.named_parameters(), *module.named_buffers()]}
    state.update({f"{path}:hook": type(m._hf_hook).__name__ for path, m in module.named_modules()
                  if hasattr(m, "_hf_hook")})
    return state


def assert_gathers(module: nn.Module, original: dict[str, torch.Tensor], expected_names: set[str]) -> None:
    placed = placement_of(module)
    with measure_transfers() as meter:
        weights = offloaded_weights(module)
        assert set(weights) == expected_names
        assert all(weights[name].device.type == "cpu" for name in weights)
        with offloaded_weights_in_state_dict(module):
            state_dict = module.state_dict()
    assert meter.host_to_accelerator_bytes == 0
    assert placement_of(module) == placed  # nothing moved, no hook added or removed
    assert set(state_dict) == set(original)
    for name, tensor in state_dict.items():
        assert torch.equal(tensor.cpu(), original[name]), name


def test_a_device_map_serves_cpu_entries_from_ram_and_disk_entries_from_the_checkpoint(one_gpu, tmp_path):
    module, original = denoiser()
    index = checkpoint_index(module, tmp_path, ("blocks.4", "blocks.5"))
    resident = ("proj_in", "blocks.0", "blocks.2", "blocks.3", "norm", "proj_out")
    for path in resident:
        module.get_submodule(path).to(torch_device(0))
    dispatch(module, {**{path: 0 for path in resident}, "blocks.1": "cpu", "blocks.4": "disk", "blocks.5": "disk"},
             disk_weights=index)
    served = {name for name, _ in module.named_parameters() if name.startswith(("blocks.1.", "blocks.4.", "blocks.5."))}
    assert_gathers(module, original, served)  # the CPU-served block from RAM, the disk ones from the checkpoint


def test_group_offloading_to_disk_files_is_read_from_them(tmp_path):
    module, original = denoiser()
    apply_group_offloading(module, GroupOffloadingConfig(onload_device="cpu", offload_to_disk_path=tmp_path))
    assert_gathers(module, original, {name for name, t in module.state_dict().items() if t.is_meta})
    with torch.no_grad():  # still offloaded as before: it runs and rests on disk again
        module(torch.zeros(2, 16), torch.zeros(2, 16))
    assert module.blocks[0].attn.weight.is_meta


def test_group_offloading_in_ram_and_sequential_offload(tmp_path):
    module, original = denoiser()
    apply_group_offloading(module, GroupOffloadingConfig(onload_device="cpu"))
    assert_gathers(module, original, set())  # host-homed groups hold real tensors: nothing to read
    other, original = denoiser()
    apply_sequential_cpu_offload(other, execution_device="cpu")
    assert_gathers(other, original, {name for name, _ in other.named_parameters()})


def test_per_call_residency_reads_disk_homed_units_from_the_checkpoint(one_gpu, tmp_path):
    module, original = denoiser()
    index = checkpoint_index(module, tmp_path, ("blocks.3", "blocks.4", "blocks.5"))
    resident = ("proj_in", "blocks.0", "blocks.1", "norm", "proj_out")
    for path in resident:
        module.get_submodule(path).to(torch_device(0))
    device_map = {**{path: 0 for path in resident}, "blocks.2": "cpu", "blocks.3": "disk", "blocks.4": "disk",
                  "blocks.5": "disk"}
    apply_residency(module, ResidencyConfig(execution_device=0, device_map=device_map,
                                            per_call_modules=("blocks.2", "blocks.3"),
                                            streamed_modules=("blocks.4", "blocks.5"), disk_weights=index))
    assert_gathers(module, original, set(index))


def test_tied_weights_keep_sharing_memory_and_unserved_placeholders_are_named(tmp_path):
    module = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    module[1].weight = module[0].weight  # tied, as a language model's head
    original = module[0].weight.detach().clone()
    apply_group_offloading(module, GroupOffloadingConfig(onload_device="cpu", offload_type="leaf_level",
                                                         offload_to_disk_path=tmp_path))
    with offloaded_weights_in_state_dict(module):
        state_dict = module.state_dict()
    # One tensor for both names, as in the module: transformers' save finds ties by shared memory.
    assert state_dict["0.weight"] is state_dict["1.weight"] and torch.equal(state_dict["0.weight"], original)
    loose = nn.Linear(2, 2, device="meta")  # never loaded: nothing serves it
    assert unserved_placeholders(loose, offloaded_weights(loose)) == ["weight", "bias"]


def test_an_offload_index_is_read_into_memory_whatever_device_its_loader_reads_onto(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(4.0)}, str(path))
    loader = OffloadedWeightsLoader(index={"w": {"safetensors_file": str(path), "weight_name": "w",
                                                 "dtype": "float16"}}, device="meta")
    tensor = read_into_memory(loader, "w")
    assert tensor.device.type == "cpu" and tensor.dtype == torch.float16 and tensor.tolist() == [0, 1, 2, 3]

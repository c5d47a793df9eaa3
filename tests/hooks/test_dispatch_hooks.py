"""Dispatch hooks: one input-moving hook per whole component, one per entry of a split one, weight-serving hooks
for streamed entries, and list arguments a module writes into (Wan's VAE causal cache) kept the caller's own
under every placement kind. Accelerators are virtual (PLACEMENT_VIRTUAL_ACCELERATORS=2): CPU-backed."""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from accelerate.hooks import remove_hook_from_module
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import save_file
from torch import nn

from hooks.dispatch import ServeWeightsHook, dispatch, undispatch
from hooks.group_offload.offload import GroupOffloadHook
from hooks.hook_utils import hooks_of
from hooks.input_moving import MoveInputsHook, move_inputs_of_entry_methods, move_to_device, restore_entry_methods
from hooks.techniques import apply_component_plan
from placement.devices import torch_device
from placement.plan_schema import ComponentPlan, PlacementKind

from resident_weights import place_resident_weights
from same_output import assert_same_output


@pytest.fixture(autouse=True)
def two_virtual_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


class CachedConv(nn.Module):
    """Writes its input into `cache[index]` and adds what the cache held before: Wan's causal conv pattern."""

    def __init__(self, width: int, index: int):
        super().__init__()
        self.index = index
        self.linear = nn.Linear(width, width)

    def forward(self, x, cache: list):
        previous = cache[self.index]
        cache[self.index] = x.detach().clone()
        out = self.linear(x)
        return out if previous is None else out + previous


class CachedStack(nn.Module):
    _no_split_modules = ["CachedConv"]

    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.convs = nn.ModuleList(CachedConv(width, index) for index in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x, cache: list):
        for conv in self.convs:
            x = conv(x, cache)
        return self.head(x)


def twin_models(seed: int = 0) -> tuple[CachedStack, CachedStack]:
    torch.manual_seed(seed)
    reference = CachedStack().eval()
    model = CachedStack().eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def run_twice(model: nn.Module) -> tuple[torch.Tensor, list]:
    """Two chunks through one cache, as Wan's VAE decodes frame chunks: the second chunk reads the first's writes."""
    cache: list = [None] * 3
    torch.manual_seed(1)
    first, second = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        model(first, cache)
        out = model(second, cache)
    return out, cache


def serve_from_disk(model: nn.Module, tmp_path) -> dict:
    """Every parameter of `model` on meta, served by an offload index over a safetensors file."""
    tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path))
    for name in tensors:
        set_module_tensor_to_device(model, name, "meta")
    return {name: {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"} for name in tensors}


def plan_of(kind: PlacementKind, device_map: dict, execution) -> ComponentPlan:
    devices = sorted(set(device_map.values()), key=str)
    return ComponentPlan(name="vae", kind=kind, devices=devices, execution_device=execution, bytes=1,
                         device_map=device_map, placed_bytes=dict.fromkeys(devices, 1))


def hooks_by_type(module: nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, submodule in module.named_modules():
        for hook in hooks_of(submodule):
            counts[type(hook).__name__] = counts.get(type(hook).__name__, 0) + 1
    return counts


PLACEMENTS = {
    "whole": (PlacementKind.WHOLE, {"": 1}, 1),
    "cpu": (PlacementKind.CPU, {"": "cpu"}, "cpu"),
    "split": (PlacementKind.SPLIT, {"convs.0": 0, "convs.1": 0, "convs.2": 1, "head": 1}, 0),
    "offloaded": (PlacementKind.OFFLOADED, {"": "cpu"}, 0),
    "disk": (PlacementKind.DISK, {"": "disk"}, 0),
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_writes_into_a_list_argument_reach_the_caller_under_every_placement(placement, tmp_path):
    reference, model = twin_models()
    kind, device_map, execution = PLACEMENTS[placement]
    disk_weights = serve_from_disk(model, tmp_path) if kind is PlacementKind.DISK else None
    place_resident_weights(model, device_map)
    apply_component_plan(model, plan_of(kind, device_map, execution), disk_weights=disk_weights)
    expected, expected_cache = run_twice(reference)
    out, cache = run_twice(model)
    assert all(entry is not None for entry in cache)  # every write reached the caller's list
    # The cache holds what the module wrote, on the device it ran on; an offloaded module returns its output there.
    assert_same_output(out.cpu(), expected)
    for got, want in zip(cache, expected_cache):
        assert_same_output(got.cpu(), want)
    undispatch(model)
    assert hooks_by_type(model) == {}


def test_hooks_per_placement_kind(tmp_path):
    counts = {}
    for placement, (kind, device_map, execution) in PLACEMENTS.items():
        _, model = twin_models()
        disk_weights = serve_from_disk(model, tmp_path) if kind is PlacementKind.DISK else None
        apply_component_plan(model, plan_of(kind, device_map, execution), disk_weights=disk_weights)
        counts[placement] = hooks_by_type(model)
    assert counts["whole"] == {"MoveInputsHook": 1} and counts["cpu"] == {"MoveInputsHook": 1}
    assert counts["split"] == {"MoveInputsHook": 1 + 4}  # the top, then one per entry of the split map
    # group offloading, and at the top the hook that returns outputs to the caller's device as the others do
    assert set(counts["offloaded"]) == {"GroupOffloadHook", "ReturnOutputsHook"}
    # disk: inputs moved at the top; each module holding weights (3 convs' linears + head) serves its own
    assert counts["disk"] == {"MoveInputsHook": 1, "ServeWeightsHook": 4}


def test_whole_component_gets_one_hook_at_its_top_where_accelerate_hooks_every_submodule():
    _, ours = twin_models()
    _, theirs = twin_models()
    dispatch(ours, {"": 0})
    dispatch_model(theirs, device_map={"": "cpu"}, force_hooks=True)
    hooked_ours = [name for name, m in ours.named_modules() if hasattr(m, "_hf_hook")]
    hooked_theirs = [name for name, m in theirs.named_modules() if hasattr(m, "_hf_hook")]
    assert hooked_ours == [""] and isinstance(ours._hf_hook, MoveInputsHook)
    assert len(hooked_theirs) == len(list(theirs.modules()))  # accelerate: every submodule
    assert ours.hf_device_map == {"": 0}
    remove_hook_from_module(theirs, recurse=True)


def test_accelerates_dispatch_loses_the_list_writes_ours_keeps():
    """The bug this runtime fixes: send_to_device rebuilds the list, so the module writes into a copy."""
    reference, theirs = twin_models()
    dispatch_model(theirs, device_map={"": "cpu"}, force_hooks=True)
    _, cache = run_twice(theirs)
    assert cache == [None, None, None]
    remove_hook_from_module(theirs, recurse=True)


def test_split_output_returns_to_the_callers_device_and_streams_cpu_entries():
    reference, model = twin_models()
    dispatch(place_resident_weights(model, {"head": 1}), {"convs": "cpu", "head": 1}, execution_device=0)
    assert isinstance(model.convs._hf_hook, MoveInputsHook)  # the entry's top: inputs moved, no weights
    assert isinstance(model.convs[0].linear._hf_hook, ServeWeightsHook)
    assert model.convs[0].linear.weight.device.type == "meta"  # streamed per forward, not resident
    expected, _ = run_twice(reference)
    out, _ = run_twice(model)
    assert_same_output(out, expected)
    undispatch(model)
    assert model.convs[0].linear.weight.device.type == "cpu"


def test_move_to_device_keeps_what_is_already_there():
    cpu = torch.device("cpu")
    tensor = torch.ones(2)
    nested = [tensor, {"a": tensor}, (tensor, None)]
    assert move_to_device(nested, cpu) is nested
    assert nested[0] is tensor and nested[1]["a"] is tensor
    args = (tensor, nested)
    assert move_to_device(args, cpu) is args
    elsewhere = [torch.ones(2), None]  # "meta" stands in for another device on a CPU-only machine
    moved = move_to_device(elsewhere, torch.device("meta"))
    assert moved is elsewhere and elsewhere[0].device.type == "meta"  # moved in place: the caller's list itself


def test_group_offload_hooks_on_an_offloaded_component_onload_to_the_virtual_accelerator():
    _, model = twin_models()
    apply_component_plan(model, plan_of(PlacementKind.OFFLOADED, {"": "cpu"}, 1))
    roots = [hook for hook in hooks_of(model) if isinstance(hook, GroupOffloadHook)]
    assert roots and roots[0].execution_device == torch_device(1)
    undispatch(model)


def tiny_wan_vae():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                      temperal_downsample=[True], attn_scales=[]).eval()


WAN_PLACEMENTS = {
    "whole": (PlacementKind.WHOLE, {"": 1}, 1),
    "split": (PlacementKind.SPLIT, {"encoder": 0, "quant_conv": 0, "post_quant_conv": 0, "decoder.conv_in": 0,
                                    "decoder.mid_block": 0, "decoder.up_blocks": 1, "decoder.norm_out": 1,
                                    "decoder.nonlinearity": 1, "decoder.conv_out": 1}, 0),
    "offloaded": (PlacementKind.OFFLOADED, {"": "cpu"}, 0),
}


@pytest.mark.parametrize("placement", list(WAN_PLACEMENTS))
def test_wan_vae_decodes_every_frame_under_our_dispatch(placement):
    """Wan's VAE writes its causal cache into a list argument: under accelerate's dispatch the writes go to
    copies and 2 latent frames decode to 2 frames instead of 3. Ours decodes what the plain module does."""
    vae = tiny_wan_vae()
    latents = torch.randn(1, 4, 2, 8, 8)
    with torch.no_grad():
        expected = vae.decode(latents).sample
    kind, device_map, execution = WAN_PLACEMENTS[placement]
    apply_component_plan(place_resident_weights(vae, device_map), plan_of(kind, device_map, execution))
    with torch.no_grad():
        decoded = vae.decode(latents).sample
    assert decoded.shape[2] == 3
    assert_same_output(decoded.cpu(), expected)  # decoded on the VAE's device
    undispatch(vae)
    assert hooks_by_type(vae) == {} and "decode" not in vae.__dict__


def test_wan_vae_under_accelerates_dispatch_loses_frames():
    vae = tiny_wan_vae()
    dispatch_model(vae, device_map={"": "cpu"}, force_hooks=True)
    with torch.no_grad():
        assert vae.decode(torch.randn(1, 4, 2, 8, 8)).sample.shape[2] == 2  # the bug ours fixes
    remove_hook_from_module(vae, recurse=True)


def test_a_whole_component_entered_through_decode_moves_its_inputs():
    """The top hook wraps forward; a VAE is called through decode, which must move its inputs as well."""

    class Decoder(nn.Module):
        def decode(self, latents, cache):
            return latents.device, cache

    module = Decoder()
    move_inputs_of_entry_methods(module, torch.device("meta"))  # meta stands in for a GPU on a CPU machine
    cache = [torch.ones(1)]
    device, seen = module.decode(torch.ones(2), cache)
    assert device.type == "meta" and seen is cache and cache[0].device.type == "meta"
    restore_entry_methods(module)
    assert module.decode(torch.ones(2), [])[0].type == "cpu"

    vae = tiny_wan_vae()
    dispatch(vae, {"": 0})
    assert "decode" in vae.__dict__ and "encode" in vae.__dict__
    undispatch(vae)
    assert "decode" not in vae.__dict__ and "encode" not in vae.__dict__


def test_a_dispatched_whole_component_refuses_other_offloading_until_undispatched():
    from hooks.group_offload.offload import GroupOffloadingConfig, apply_group_offloading
    from hooks import OffloadConflictError

    _, model = twin_models()
    dispatch(model, {"": 0})
    with pytest.raises(OffloadConflictError, match="already has a device map"):
        apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))
    undispatch(model)
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))
    undispatch(model)


class Positions(nn.Module):
    """Holds no weights; builds positions on the `device` its caller names and meets frequencies it is given, as
    Mochi's RoPE does (the caller passes `device=hidden_states.device`)."""

    def forward(self, frequencies, count, device=None):
        positions = torch.arange(count, device=device, dtype=torch.float32)
        return positions[:, None] * frequencies[None, :]


class WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.frequencies = nn.Parameter(torch.linspace(0.1, 1.0, 4))
        self.embed = nn.Linear(4, 4)
        self.positions = Positions()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        h = self.embed(x)
        return self.head(h + self.positions(self.frequencies, x.shape[0], device=h.device))


def test_a_device_argument_crossing_a_cut_names_the_device_the_module_runs_on():
    """Split so that `positions` runs on GPU 1 while its caller's device is GPU 0: the device its caller names
    crosses the cut like a tensor (before, arange on vgpu:0 met the frequencies moved to vgpu:1)."""
    torch.manual_seed(0)
    model = WithPositions()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    device_map = {"frequencies": 0, "embed": 0, "positions": 1, "head": 1}
    dispatch(place_resident_weights(model, device_map), device_map)
    with torch.no_grad():
        assert_same_output(model(x.to(torch_device(0))).cpu(), expected)
    undispatch(model)
    assert move_to_device(torch.device("cpu"), torch_device(1)) == torch.device("cpu")  # the host stays the host

"""hooks.edit_placed_weights: a LoRA made by peft, loaded, fused, unfused and unloaded on a module under every
runtime arrangement, computes what the same LoRA computes on the plain module, and its tensors live where
their layer's weights live (the accelerator of a resident layer, host RAM beside weights served from RAM or
disk, the offload group or per-call/streamed unit of their layer). Virtual accelerators: strict ones raise
on a tensor left on the wrong device, as a GPU does; the structural checks hold in either mode."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import save_file
from torch import nn

peft = pytest.importorskip("peft")
from peft import LoKrConfig, LoraConfig, inject_adapter_in_model  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

from hooks import (
    GroupOffloadingConfig,
    OffloadConflictError,
    ResidencyConfig,
    apply_group_offloading,
    apply_residency,
    dispatch,
    edit_placed_weights,
    group_offloading_session,
    measure_transfers,
    refresh_placement,
    undispatch,
    weight_homes,
)
from hooks.hook_utils import hooks_of  # noqa: E402
from hooks.input_moving import MoveInputsHook  # noqa: E402
from placement.devices import is_accelerator, torch_device  # noqa: E402
from same_output import assert_same_output

TARGETS = ["attn", "mlp", "proj_out"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.attn(x)) * self.mlp(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.proj_out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.proj_in(x)
        for block in self.blocks:
            h = block(h)
        return self.proj_out(h)


X = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))


def make() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def lora_state(config: LoraConfig):
    """A LoRA with non-zero B (it changes the output), as peft saves it."""
    torch.manual_seed(2)
    model = inject_adapter_in_model(config, make(), adapter_name="a")
    return get_peft_model_state_dict(model, adapter_name="a")


CONFIG = LoraConfig(r=2, lora_alpha=2, target_modules=TARGETS, init_lora_weights=False)
LORA = lora_state(CONFIG)


def load_lora(model: nn.Module) -> None:
    inject_adapter_in_model(CONFIG, model, adapter_name="a")
    set_peft_model_state_dict(model, LORA, adapter_name="a")


def tuner_layers(model):
    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def unload(model: nn.Module) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())


def run(model) -> torch.Tensor:
    with torch.no_grad():
        return model(X).to("cpu")


def references():
    plain = make()
    base = run(plain)
    load_lora(plain)
    lora = run(plain)
    for layer in tuner_layers(plain):
        layer.merge()
    fused = run(plain)
    for layer in tuner_layers(plain):
        layer.unmerge()
    return {"base": base, "lora": lora, "fused": fused, "unfused": run(plain)}


def on_disk(model: nn.Module, tmp_path, prefixes) -> dict:
    """Put the parameters under `prefixes` on meta, served from a safetensors file (as the loader does)."""
    names = [name for name, _ in model.named_parameters() if any(name.startswith(p) for p in prefixes)]
    path = tmp_path / "weights.safetensors"
    save_file({name: model.get_parameter(name).detach().clone() for name in names}, str(path))
    for name in names:
        set_module_tensor_to_device(model, name, "meta")
    return {name: {"safetensors_file": str(path), "weight_name": name, "dtype": "float32"} for name in names}


def resident(model: nn.Module, device_map) -> None:
    """What the loader does before dispatch: weights of accelerator entries on their accelerator."""
    for path, device in device_map.items():
        if is_accelerator(device):
            model.get_submodule(path).to(torch_device(device))


# Each arrangement: a function placing a fresh model (tmp_path for disk files), and the home each layer's
# weights have ("proj_out" / a block's "attn").
def whole(tmp_path):
    model = make()
    resident(model, {"": 0})
    return dispatch(model, {"": 0})


SPLIT = {"proj_in": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "proj_out": 0}


def split(tmp_path):
    model = make()  # proj_out, a LoRA target, is itself an entry: its input arrives from GPU 1
    resident(model, SPLIT)
    return dispatch(model, SPLIT)


def served_from_ram(tmp_path):
    return dispatch(make(), {"": "cpu"}, execution_device=0)


def served_from_disk(tmp_path):
    model = make()
    index = on_disk(model, tmp_path, ["blocks.", "proj_out."])
    resident(model, {"proj_in": 0})
    return dispatch(model, {"proj_in": 0, "blocks": "disk", "proj_out": "disk"}, disk_weights=index)


def cpu(tmp_path):
    return dispatch(make(), {"": "cpu"})


def group_blocks(tmp_path):
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device=0))
    return model


def group_leaves(tmp_path):
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device=0, offload_type="leaf_level"))
    return model


def group_to_disk(tmp_path):
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device=0, offload_to_disk_path=tmp_path / "groups"))
    return model


RESIDENCY_MAP = {"proj_in": 0, "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk", "proj_out": 0}


def residency(tmp_path):
    model = make()
    index = on_disk(model, tmp_path, ["blocks.2."])
    resident(model, RESIDENCY_MAP)
    apply_residency(model, ResidencyConfig(execution_device=0, device_map=RESIDENCY_MAP,
                                           per_call_modules=("blocks.0",), streamed_modules=("blocks.1", "blocks.2"),
                                           disk_weights=index))
    return model


ARRANGEMENTS = {  # name: (placer, {layer: (home of its weights, home of its LoRA's)})
    "whole": (whole, {"proj_out": (0, 0), "blocks.1.attn": (0, 0)}),
    "split": (split, {"proj_out": (0, 0), "blocks.1.attn": (1, 1)}),
    "cpu": (cpu, {"proj_out": ("cpu", "cpu"), "blocks.1.attn": ("cpu", "cpu")}),
    "served from RAM": (served_from_ram, {"proj_out": ("cpu", "cpu"), "blocks.1.attn": ("cpu", "cpu")}),
    # The checkpoint's files cannot take a LoRA: it waits in host RAM and is served beside them.
    "served from disk": (served_from_disk, {"proj_out": ("disk", "cpu"), "blocks.1.attn": ("disk", "cpu")}),
    "group, blocks": (group_blocks, {"proj_out": ("cpu", "cpu"), "blocks.1.attn": ("cpu", "cpu")}),
    "group, leaves": (group_leaves, {"proj_out": ("cpu", "cpu"), "blocks.1.attn": ("cpu", "cpu")}),
    # A group's own offload file does: the LoRA joins it.
    "group, to disk": (group_to_disk, {"proj_out": ("disk", "disk"), "blocks.1.attn": ("disk", "disk")}),
    "per-call residency": (residency, {"proj_out": (0, 0), "blocks.0.attn": ("cpu", "cpu"),
                                       "blocks.2.attn": ("disk", "cpu")}),
}
WRITABLE = [name for name, (_, homes) in ARRANGEMENTS.items() if all(base != "disk" for base, _ in homes.values())]


@pytest.fixture
def gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture(scope="module")
def expected():
    return references()


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_a_lora_loaded_into_a_placed_module_follows_its_layer(arrangement, gpus, expected, tmp_path):
    place, layer_homes = ARRANGEMENTS[arrangement]
    model = place(tmp_path)
    assert_same_output(run(model), expected["base"])
    with edit_placed_weights(model):
        load_lora(model)
    assert_same_output(run(model), expected["lora"])
    assert_same_output(run(model), expected["lora"])  # and again: nothing was lost between calls
    homes = weight_homes(model)
    for layer, (home, lora_home) in layer_homes.items():
        assert homes[f"{layer}.base_layer.weight"] == home
        assert homes[f"{layer}.lora_A.a.weight"] == homes[f"{layer}.lora_B.a.weight"] == lora_home

    with edit_placed_weights(model):
        unload(model)
    assert_same_output(run(model), expected["base"])
    assert not [name for name in weight_homes(model) if "lora" in name]


@pytest.mark.parametrize("arrangement", WRITABLE)
@pytest.mark.parametrize("safe_merge", [False, True], ids=["in place", "replaced"])
def test_fuse_and_unfuse_write_where_the_weights_live(arrangement, safe_merge, gpus, expected, tmp_path):
    model = ARRANGEMENTS[arrangement][0](tmp_path)
    with edit_placed_weights(model):
        load_lora(model)
    with edit_placed_weights(model):
        for layer in tuner_layers(model):
            layer.merge(safe_merge=safe_merge)
    assert_same_output(run(model), expected["fused"])
    assert_same_output(run(model), expected["fused"])
    with edit_placed_weights(model):
        for layer in tuner_layers(model):
            layer.unmerge()
    assert_same_output(run(model), expected["unfused"])


def test_removing_the_placement_keeps_the_adapter(gpus, expected, tmp_path):
    model = served_from_disk(tmp_path)
    with edit_placed_weights(model):
        load_lora(model)
    undispatch(model)  # disk weights read back, served LoRA matrices back in their modules
    assert not [name for name, tensor in model.named_parameters() if tensor.is_meta]
    assert_same_output(run(model.to("cpu")), expected["lora"])


def test_a_lora_in_an_offloaded_block_moves_with_its_block(gpus, tmp_path):
    model = group_blocks(tmp_path)
    run(model)
    with measure_transfers() as before:
        run(model)
    with edit_placed_weights(model):
        load_lora(model)
    session = group_offloading_session(model)
    block = next(group for group in session.groups if group.name == "blocks.1")
    names = {entry.key for entry in block.entries}
    assert {"blocks.1.attn.lora_A.a.weight", "blocks.1.mlp.lora_B.a.weight"} <= names
    lora_bytes = sum(tensor.numel() * tensor.element_size() for tensor in LORA.values())
    with measure_transfers() as after:
        run(model)
    assert after.weights.host_to_accelerator_bytes == before.weights.host_to_accelerator_bytes + lora_bytes
    with edit_placed_weights(model):
        unload(model)
    with measure_transfers() as unloaded:
        run(model)
    assert unloaded.weights.host_to_accelerator_bytes == before.weights.host_to_accelerator_bytes


def test_a_wrapped_entry_of_a_split_gets_the_input_hook_of_the_layer_it_wraps(gpus, tmp_path):
    model = split(tmp_path)
    with edit_placed_weights(model):
        load_lora(model)
    wrapper = model.get_submodule("proj_out")
    moving = [hook for hook in hooks_of(wrapper) if isinstance(hook, MoveInputsHook)]
    assert [hook.place for hook in moving] == [0]  # the LoRA branch reads the input the base layer's hook moves


@pytest.mark.parametrize("arrangement", ["served from disk", "group, to disk", "per-call residency"])
def test_writing_into_disk_homed_weights_is_refused_and_the_disk_copy_serves(arrangement, gpus, expected, tmp_path):
    model = ARRANGEMENTS[arrangement][0](tmp_path)
    with edit_placed_weights(model):
        load_lora(model)
    layer = model.get_submodule("blocks.2.attn")  # its weights are on disk in each of these arrangements
    assert weight_homes(model)["blocks.2.attn.base_layer.weight"] == "disk"
    with pytest.raises(RuntimeError):  # in place: torch refuses to write into the stand-in
        with edit_placed_weights(model):
            layer.merge()
    with pytest.raises(OffloadConflictError, match=r"on disk; the edit tried to change them"):
        with edit_placed_weights(model):  # a new tensor given as the weight's data: noticed, dropped
            model.get_submodule("blocks.2.attn.base_layer").weight.data = torch.ones(8, 8)
    assert_same_output(run(model), expected["lora"])


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_an_edit_made_outside_leaves_tensors_without_data_which_refresh_reports(gpus, tmp_path):
    model = served_from_disk(tmp_path)
    load_lora(model)  # peft creates the LoRA beside meta placeholders: its values are dropped
    with pytest.raises(OffloadConflictError, match=r"no data"):
        refresh_placement(model)


def test_nested_edits_of_one_module_are_one_edit(gpus, expected, tmp_path):
    model = group_blocks(tmp_path)
    with edit_placed_weights(model):
        with edit_placed_weights(model):
            load_lora(model)
    assert_same_output(run(model), expected["lora"])


def test_a_disk_homed_unit_loaded_for_its_phase_is_still_homed_on_disk(gpus, tmp_path):
    """A per-call unit stays on its GPU after a call until its room is needed; its home is the checkpoint's file
    all the same (read from its store: the tensors were on the GPU, so a fuse went ahead into stand-ins)."""
    model = make()
    index = on_disk(model, tmp_path, ["blocks.2."])
    resident(model, RESIDENCY_MAP)
    apply_residency(model, ResidencyConfig(execution_device=0, device_map=RESIDENCY_MAP,
                                           per_call_modules=("blocks.0", "blocks.2"), streamed_modules=("blocks.1",),
                                           disk_weights=index))
    run(model)
    assert model.get_submodule("blocks.2.attn").weight.device.type == "vgpu"  # loaded, and kept for the next call
    homes = weight_homes(model)
    assert homes["blocks.2.attn.weight"] == "disk" and homes["blocks.0.attn.weight"] == "cpu"


@pytest.mark.parametrize("arrangement", ["served from disk", "group, leaves", "per-call residency"])
def test_adapters_kept_in_containers_follow_the_layer_that_uses_them(arrangement, gpus, tmp_path):
    # LoKr keeps its factors in ParameterDicts, which never run a forward of their own.
    config = LoKrConfig(r=2, alpha=2, target_modules=TARGETS, init_weights=False)
    torch.manual_seed(3)
    plain = inject_adapter_in_model(config, make(), adapter_name="k")
    state = get_peft_model_state_dict(plain, adapter_name="k")
    model = ARRANGEMENTS[arrangement][0](tmp_path)
    with edit_placed_weights(model):
        inject_adapter_in_model(config, model, adapter_name="k")
        set_peft_model_state_dict(model, state, adapter_name="k")
    assert_same_output(run(model), run(plain))
    assert_same_output(run(model), run(plain))


@pytest.mark.gpu
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_on_a_gpu_a_lora_joins_pinned_groups_prefetched_on_a_side_stream(offload_type, expected):
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device=0, offload_type=offload_type, use_stream=True))
    with edit_placed_weights(model):
        load_lora(model)
    lora = [tensor for name, tensor in model.named_parameters() if "lora" in name]
    assert lora and all(tensor.is_pinned() for tensor in lora)  # in the store between calls, pinned for the stream
    for _ in range(2):  # the first call traces the order, the second prefetches
        with torch.no_grad():
            torch.testing.assert_close(model(X.to("cuda:0")).cpu(), expected["lora"], atol=1e-5, rtol=0)


class TiedNet(Net):
    """T5's shape: `shared` and `encoder.embed` are one Parameter, and device maps name only `shared`."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(5, 6)
        self.encoder = nn.Module()
        self.encoder.embed = self.shared

    def forward(self, x):
        return super().forward(x + self.encoder.embed.weight[:1])


def test_an_edit_keeps_a_tied_alias_the_device_map_does_not_name_where_its_tensor_lives(gpus):
    torch.manual_seed(0)
    model = TiedNet()
    expected = run(model)
    device_map = {"shared": 0, **RESIDENCY_MAP, "blocks.2": "cpu"}
    resident(model, device_map)
    apply_residency(model, ResidencyConfig(execution_device=0, device_map=device_map, per_call_modules=("blocks.0",),
                                           streamed_modules=("blocks.1", "blocks.2")))
    with edit_placed_weights(model):  # before the fix: "encoder.embed (host-homed, in no per-call or streamed unit)"
        pass
    assert_same_output(run(model), expected)
    homes = weight_homes(model)
    assert homes["shared.weight"] == homes["encoder.embed.weight"] == 0

"""Model-level strategies (`placement.plan(..., scope="model")`, what ModelMixin.from_pretrained(device_map=...)
plans): accelerate's meaning of "auto"/"balanced"/"balanced_low_0"/"sequential", dicts, single devices, and the
one-component Plan they produce (kinds, fallback reasons, explain)."""

import warnings

import pytest
import torch

import placement
from accelerate import infer_auto_device_map, init_empty_weights
from accelerate.utils import get_balanced_memory
from torch import nn

from placement.devices import accelerators_present
from placement.errors import DoesNotFitError, InvalidDeviceError, PlanError
from placement.plan_schema import PlacementKind
from placement.sizing import size_module

GB = 1000**3


class Block(nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.attn = nn.Module()
        self.attn.weight = nn.Parameter(torch.empty(numel // 2), requires_grad=False)
        self.mlp = nn.Module()
        self.mlp.weight = nn.Parameter(torch.empty(numel - numel // 2), requires_grad=False)


class Net(nn.Module):
    """Embedding, blocks of `numels` fp32 elements (never cut), a head and a persistent buffer."""

    _no_split_modules = ["Block"]

    def __init__(self, numels=(1000,) * 6):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block(n) for n in numels)
        self.head = nn.Linear(16, 4)
        self.register_buffer("table", torch.zeros(8))


class Opaque(Net):
    _no_split_modules = None


def model_plan(model, strategy, *, max_memory=None, dtype=None, offload_folder=None):
    name = type(model).__name__
    if max_memory is not None:  # these tiny models' budgets in bytes, written as a user writes exact bytes
        max_memory = {device: f"{size}B" if isinstance(size, int) else size for device, size in max_memory.items()}
    return placement.plan({name: model}, strategy=strategy, max_memory=max_memory, dtype=dtype,
                          offload_folder=offload_folder, scope="model")


def model_device_map(model, strategy, **kwargs):
    """The model's device map (relative to it), as model_map.model_device_map returned before the one planner."""
    return model_plan(model, strategy, **kwargs).components[type(model).__name__].device_map


def _meta(cls=Net, *args):
    with init_empty_weights():
        return cls(*args)


def _devices_of_blocks(device_map, count):
    """Device of each block; fails if a key points inside a block (the block would be cut)."""
    for key in device_map:
        parts = key.split(".")
        assert not (len(parts) > 2 and parts[0] == "blocks"), f"{key} cuts a block"
    result = []
    for i in range(count):
        owners = [k for k in (f"blocks.{i}", "blocks", "") if k in device_map]
        result.append(device_map[owners[0]])
    return result


def _used(model, device_map):
    size = size_module(model)
    used = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        key = next(".".join(parts[:i]) for i in range(len(parts), -1, -1) if ".".join(parts[:i]) in device_map)
        used[device_map[key]] = used.get(device_map[key], 0) + size.module_sizes[name]
    return used


def test_single_devices_mean_the_same_as_at_pipeline_level():
    model = _meta()
    gpus = {index: "1GiB" for index in range(4)}
    assert model_device_map(model, "cpu") == {"": "cpu"}
    assert model_device_map(model, "cuda", max_memory=gpus) == {"": 0}
    assert model_device_map(model, "cuda:1", max_memory=gpus) == {"": 1}
    assert model_device_map(model, 2, max_memory=gpus) == {"": 2}
    assert model_device_map(model, torch.device("cuda", 3), max_memory=gpus) == {"": 3}
    assert model_plan(model, "cpu").components["Net"].kind is PlacementKind.CPU
    pipeline_level = placement.plan({"Net": model}, strategy="cpu")
    assert pipeline_level.components == model_plan(model, "cpu").components


@pytest.mark.skipif(accelerators_present() > 0, reason="needs a machine without accelerators")
def test_without_accelerators_and_budgets_everything_goes_to_the_cpu():
    with pytest.warns(UserWarning, match="No accelerator to plan for"):
        plan = model_plan(_meta(), "auto")
    assert plan.components["Net"].device_map == {"": "cpu"}
    assert plan.strategy == "cpu"


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_strategies_never_cut_a_block_and_keep_every_budget(strategy):
    model = _meta(Net, (1000, 3000, 500, 2500, 1500, 800, 2000))
    total = size_module(model).total
    for fraction in (0.3, 0.45, 0.6, 1.0):
        budgets = {0: int(total * fraction), 1: int(total * fraction), "cpu": int(total * 0.3)}
        device_map = model_device_map(model, strategy, max_memory=budgets, offload_folder="offload")
        blocks = _devices_of_blocks(device_map, 7)
        order = [0, 1, "cpu", "disk"]
        assert [order.index(d) for d in blocks] == sorted(order.index(d) for d in blocks)
        used = _used(model, device_map)
        assert all(used[d] <= budgets[d] for d in used if d != "disk"), (strategy, fraction, used)
        if 2 * int(total * fraction) >= total + 12000:  # room for the blocks at any cut: all on GPUs
            assert set(used) <= {0, 1}, (strategy, fraction, device_map)


def test_balanced_spreads_and_low_0_keeps_gpu_0_light():
    model = _meta()
    total = size_module(model).total
    balanced = model_device_map(model, "balanced", max_memory={0: total, 1: total})
    assert set(_devices_of_blocks(balanced, 6)) == {0, 1}
    low = model_device_map(model, "balanced_low_0", max_memory={0: total, 1: total})
    assert low == {"": 1}


def test_balanced_low_0_reads_budgets_by_key_not_position():
    model = _meta()
    total = size_module(model).total
    budgets = {2: total, 5: total}
    with pytest.raises(KeyError):  # accelerate indexes max_memory[0]
        get_balanced_memory(model, max_memory=dict(budgets), no_split_module_classes=["Block"], low_zero=True)
    assert model_device_map(model, "balanced_low_0", max_memory=budgets) == {"": 5}


def test_cpu_budget_of_40_percent_gives_a_cpu_and_disk_map():
    model = _meta()
    budgets = {"cpu": int(0.4 * size_module(model).total)}
    device_map = model_device_map(model, "auto", max_memory=budgets, offload_folder="offload")
    assert set(device_map.values()) == {"cpu", "disk"}
    assert _used(model, device_map)["cpu"] <= budgets["cpu"]
    _devices_of_blocks(device_map, 6)
    with pytest.raises(DoesNotFitError, match="offload_folder"):
        model_device_map(model, "auto", max_memory=budgets)


def test_weights_that_fit_the_gpus_stay_on_them():
    # 5 blocks of 4000 B and a 32 B buffer on GPUs of 12000 B and 8032 B: accelerate keeps a block's room free on GPU 0
    # and sends the last block to the CPU; the blocks fit as 3 + 2.
    model = _meta(Net, (1000,) * 5)
    model.embed, model.head = nn.Identity(), nn.Identity()
    budgets = {0: 12000, 1: 8032, "cpu": 10**6}
    naive = infer_auto_device_map(model, max_memory=dict(budgets), no_split_module_classes=["Block"])
    assert "cpu" in naive.values()
    device_map = model_device_map(model, "sequential", max_memory=budgets)
    assert _devices_of_blocks(device_map, 5) == [0, 0, 0, 1, 1]


def test_size_strings_are_bytes_never_gigabits():
    model = _meta(Net, (250_000_000,) * 5)  # 5 GB of fp32 on meta
    device_map = model_device_map(model, "sequential", max_memory={0: "3.1GB", 1: "3.1GB", "cpu": "1GB"})
    assert set(device_map.values()) == {0, 1}
    assert _used(model, device_map)[0] <= 3.1 * GB


def test_a_class_without_no_split_modules_is_placed_whole():
    model = _meta(Opaque)
    total = size_module(model).total
    assert model_device_map(model, "auto", max_memory={0: total // 2, 1: total}) == {"": 1}
    assert model_device_map(model, "auto", max_memory={0: total // 2, 1: total // 2, "cpu": total}) == {"": "cpu"}


def test_does_not_fit_anywhere_is_a_typed_error_with_numbers():
    model = _meta()
    with pytest.raises(DoesNotFitError, match=r"Net needs .* \(float16\).*GPU 0"):
        model_device_map(
            model, "auto", max_memory={0: 100, "cpu": 100, "disk": 100}, dtype=torch.float16, offload_folder="x"
        )


def test_single_device_over_its_budget_is_an_error():
    model = _meta()
    with pytest.raises(DoesNotFitError, match="GPU 0"):
        model_device_map(model, 0, max_memory={0: 100})
    assert model_device_map(model, 0, max_memory={0: "1GiB"}) == {"": 0}


@pytest.mark.parametrize(
    ("device_map", "error", "message"),
    [
        ("balance", PlanError, r"Unknown placement strategy 'balance' \(did you mean 'balanced'\?\)\. Supported: 'balanced'"),
        ("disk", PlanError, "device_map='disk': 'disk' holds weights but cannot execute"),
        ({"blokcs": 0, "": 1}, PlanError, r"'blokcs' is not a submodule or tensor of Net\. Did you mean 'blocks'"),
        ({"embed": 0}, PlanError, r"gives no device to \d+ tensor\(s\) \(blocks\.0\.attn\.weight"),
        ({"": "gpu"}, InvalidDeviceError, r"device_map\[''\]: Invalid device 'gpu'"),
        ({"blocks": "disk", "": 0}, DoesNotFitError, "puts blocks on 'disk'"),
    ],
)
def test_bad_device_maps_are_typed_errors_naming_the_culprit(device_map, error, message):
    with pytest.raises(error, match=message):
        model_device_map(_meta(), device_map)


def test_explicit_dict_is_validated_and_normalised():
    model = _meta()
    given = {"embed": "cuda:0", "blocks.0.attn.weight": torch.device("cuda", 1), "blocks": 1, "": "cpu"}
    assert model_device_map(model, given) == {"embed": 0, "blocks.0.attn.weight": 1, "blocks": 1, "": "cpu"}
    assert model_device_map(model, {"blocks": "disk", "": 0}, offload_folder="x") == {"blocks": "disk", "": 0}
    with pytest.raises(DoesNotFitError, match=r"puts .* on GPU 1, whose max_memory is 1000 B"):
        model_device_map(model, given, max_memory={0: "1GiB", 1: 1000})


def test_no_warnings_about_absent_devices():
    model = _meta()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_device_map(model, "balanced", max_memory={0: 10**6, 7: 10**6})


def test_the_plan_names_the_kind_the_devices_and_the_reason():
    model = _meta()
    total = size_module(model).total
    whole = model_plan(model, "sequential", max_memory={0: total, 1: total})
    assert whole.components["Net"].kind is PlacementKind.WHOLE and whole.fallbacks == []
    split = model_plan(model, "balanced", max_memory={0: total, 1: total})
    component = split.components["Net"]
    assert component.kind is PlacementKind.SPLIT and component.devices == [0, 1]
    assert component.execution_device == 0 and sum(component.placed_bytes.values()) == total
    (fallback,) = split.fallbacks
    assert fallback.kind is PlacementKind.SPLIT and "Model-level 'balanced'" in fallback.reason
    assert "GPU 0" in fallback.reason and "GPU 1" in fallback.reason
    text = split.explain()
    assert "Net" in text and "split" in text
    assert placement.Plan.from_json(split.to_json()) == split


def test_weights_in_cpu_ram_executed_on_a_gpu_are_offloaded_and_disk_parts_make_it_disk():
    model = _meta()
    total = size_module(model).total
    offloaded = model_plan(model, "sequential", max_memory={0: total // 2, "cpu": total})
    component = offloaded.components["Net"]
    assert component.kind is PlacementKind.OFFLOADED, component.device_map
    assert component.execution_device == 0 and set(component.devices) == {0, "cpu"}
    assert component.streamed_unit_bytes > 0
    on_disk = model_plan(model, "sequential", max_memory={0: total // 2, "cpu": total // 4}, offload_folder="x")
    assert on_disk.components["Net"].kind is PlacementKind.DISK
    assert {0, "disk"} <= set(on_disk.components["Net"].devices)
    assert on_disk.components["Net"].execution_device == 0
    host_only = model_plan(model, "auto", max_memory={"cpu": total // 2}, offload_folder="x")
    assert host_only.components["Net"].kind is PlacementKind.DISK
    assert host_only.components["Net"].execution_device == "cpu"


def test_the_ledger_records_what_the_model_level_strategy_placed():
    model = _meta()
    total = size_module(model).total
    plan = model_plan(model, "balanced", max_memory={0: total, 1: total, "cpu": total})
    placed = plan.components["Net"].placed_bytes
    for device in (0, 1):
        assert plan.device(device).weight_bytes == placed[device]


def test_model_scope_places_exactly_one_model():
    with pytest.raises(PlanError, match="scope='model' places one model; got 2"):
        placement.plan({"a": _meta(), "b": _meta()}, strategy="auto", max_memory={0: "1GiB"}, scope="model")


def test_a_dict_at_model_scope_is_exact_and_pinned():
    model = _meta()
    plan = model_plan(model, {"": "cpu", "blocks.1": "disk"}, offload_folder="x")
    component = plan.components["Net"]
    assert component.device_map == {"": "cpu", "blocks.1": "disk"}
    assert component.kind is PlacementKind.DISK and component.pinned
    assert plan.fallbacks == []


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_predicted_peaks_keep_every_budget_given(strategy):
    # The streamed block charged to the execution device is the room accelerate's map keeps free for it.
    model = _meta(Net, (1000, 3000, 500, 2500, 1500, 800, 2000))
    total = size_module(model).total
    for fraction in (0.3, 0.45, 0.6, 1.0):
        budgets = {0: int(total * fraction), 1: int(total * fraction), "cpu": int(total * 0.3)}
        plan = model_plan(model, strategy, max_memory=budgets, offload_folder="offload")
        over = [(d.device, d.predicted_peak, d.budget) for d in plan.devices if d.left is not None and d.left < 0]
        assert over == [], (strategy, fraction, plan.components["Net"].device_map)

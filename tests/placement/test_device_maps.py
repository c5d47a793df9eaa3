"""placement.device_maps: the one module for reading device maps, and the one 'disk cannot execute' check."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from torch import nn

from placement.device_maps import (
    check_can_execute,
    distinct_tensor_names,
    flatten_device_map,
    is_single_device,
    merge_to_prefixes,
    needs_hooks,
    owning_key,
    single_device,
    tensor_devices,
)
from placement.devices import torch_device
from placement.errors import InvalidDeviceError, PlacementError, PlanError
from placement.strategies import parse_strategy


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.register_buffer("scale", torch.ones(1))


def test_owning_key_is_the_longest_containing_prefix():
    keys = {"", "b", "b.1"}
    assert owning_key("b.1.weight", keys) == "b.1"
    assert owning_key("b.0.weight", keys) == "b"
    assert owning_key("a.weight", keys) == ""
    assert owning_key("a.weight", {"b"}) is None
    assert owning_key("ab.weight", {"a"}) is None  # a prefix of the name, not of the module path


def test_merge_and_flatten_are_inverse_views_of_one_placement():
    assert merge_to_prefixes({"b.0": 1, "b.1": 1, "a": 0}) == {"b": 1, "a": 0}
    module = Pair()
    flat = flatten_device_map(module, {"": "cpu", "b.1": "disk"})
    assert flat == {"a": "cpu", "b.0": "cpu", "b.1": "disk", "scale": "cpu"}
    assert flatten_device_map(module, {"a": 0, "b": 1, "scale": 0}) == {"a": 0, "b": 1, "scale": 0}


def test_tensor_devices_places_every_tensor_or_names_the_gap():
    with init_empty_weights():
        module = Pair()
    devices = tensor_devices(module, {"": "cpu", "b.1": "cuda:1"})
    assert devices["b.1.weight"] == 1 and devices["a.bias"] == "cpu" and devices["scale"] == "cpu"
    assert set(tensor_devices(module, None).values()) == {"cpu"}
    with pytest.raises(PlanError, match=r"does not place 3 tensor\(s\) of Pair, e.g. 'scale'"):
        tensor_devices(module, {"b": 0})
    assert issubclass(PlanError, (PlacementError, ValueError))


class TiedEncoder(nn.Module):
    """T5's shape: `shared` and `encoder.embed_tokens` hold one embedding."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(5, 2)
        self.encoder = nn.Module()
        self.encoder.embed_tokens = nn.Embedding(5, 2)
        self.encoder.embed_tokens.weight = self.shared.weight
        self.encoder.block = nn.Sequential(nn.Linear(2, 2))


def test_a_tied_tensor_is_one_tensor_placed_by_whichever_of_its_modules_the_map_names():
    module = TiedEncoder()
    assert distinct_tensor_names(module)[0] == ["shared.weight", "encoder.embed_tokens.weight"]
    # The planner's maps name the module sizing counts the tensor under (the first); either one places it.
    assert tensor_devices(module, {"shared": "cpu", "encoder.block": 0}) == {
        "shared.weight": "cpu", "encoder.block.0.weight": 0, "encoder.block.0.bias": 0}
    assert tensor_devices(module, {"encoder": 0})["shared.weight"] == 0
    with pytest.raises(PlanError, match="'shared.weight'"):
        tensor_devices(module, {"encoder.block": 0})


def test_needs_hooks_when_weights_span_devices_sit_on_disk_or_run_elsewhere():
    assert not needs_hooks({"": "cpu"})
    assert not needs_hooks({"": 0}, execution_device=0)
    assert needs_hooks({"a": 0, "b": 1})
    assert needs_hooks({"": "disk"})
    assert needs_hooks({"": "cpu"}, execution_device=0)  # CPU RAM executed by an accelerator: offloaded


@pytest.mark.parametrize(("spec", "device"), [("cpu", "cpu"), ("cuda", 0), ("cuda:1", 1), (2, 2),
                                               (torch.device("cuda", 3), 3), ("auto", None), ({"": 0}, None),
                                               (True, None), (None, None)])
def test_single_device(spec, device):
    assert single_device(spec) == device
    assert is_single_device(spec) is (device is not None)


@pytest.mark.parametrize(
    "attempt",
    [
        lambda: check_can_execute("disk", what="execution device"),
        lambda: torch_device("disk"),
        lambda: single_device("disk"),
    ],
)
def test_the_disk_cannot_execute_one_error_one_message(attempt):
    with pytest.raises(InvalidDeviceError, match="'disk' holds weights but cannot execute them"):
        attempt()
    assert not is_single_device("disk")


@pytest.mark.parametrize("scope", ["pipeline", "model"])
def test_disk_as_a_strategy_quotes_the_same_check_and_lists_the_strategies(scope):
    with pytest.raises(PlanError, match=r"'disk' holds weights but cannot execute them.*Supported: 'balanced'"):
        parse_strategy("disk", scope=scope)


def test_hooks_refuse_the_disk_as_execution_device_with_the_same_message():
    from hooks import OffloadConfigError
    from hooks import resolve_execution_device

    with pytest.raises(OffloadConfigError, match="'disk' holds weights but cannot execute them"):
        resolve_execution_device("disk")

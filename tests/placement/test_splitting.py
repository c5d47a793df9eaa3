"""Splitting one module over devices: never cut a block, respect every budget, never miss a feasible split."""

import itertools

import torch
from accelerate import infer_auto_device_map, init_empty_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from placement.sizing import size_module
from placement.device_maps import merge_to_prefixes
from placement.splitting import split_device_map


class Block(nn.Module):
    def __init__(self, numel: int, dtype=torch.float32):
        super().__init__()
        self.inner = nn.Module()
        self.inner.weight = nn.Parameter(torch.empty(numel, dtype=dtype), requires_grad=False)


class Stack(nn.Module):
    """Blocks of given element counts (fp32 unless said otherwise), each a no-split unit."""

    _no_split_modules = ["Block"]

    def __init__(self, numels, dtype=torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(n, dtype) for n in numels)


def _stack(numels):
    with init_empty_weights():
        return Stack(numels)


def _unit_devices(device_map, size):
    """The device of every split unit under `device_map`, asserting no key cuts into a unit."""
    units = {unit.path for unit in size.split_units}
    for key in device_map:
        parts = key.split(".") if key else []
        assert not any(".".join(parts[:i]) in units for i in range(len(parts))), f"{key} cuts a block"
    result = {}
    for unit in size.split_units:
        parts = unit.path.split(".")
        owners = [".".join(parts[:i]) for i in range(len(parts) + 1) if ".".join(parts[:i]) in device_map]
        assert owners, f"{unit.path} is not placed"
        result[unit.path] = device_map[owners[-1]]
    return result


def _check(device_map, size, budgets):
    placed = _unit_devices(device_map, size)
    used = dict.fromkeys(budgets, 0)
    for unit in size.split_units:
        used[placed[unit.path]] += unit.bytes
    assert all(used[d] <= budgets[d] for d in budgets), (used, budgets)
    return placed


def _feasible(sizes, budgets):
    """Brute force: some in-order (contiguous) assignment of the units to the devices fits."""
    caps = list(budgets.values())
    for cut in itertools.combinations_with_replacement(range(len(caps)), len(sizes)):
        used = [0] * len(caps)
        for size, device in zip(sizes, cut):
            used[device] += size
        if all(u <= c for u, c in zip(used, caps)):
            return True
    return False


def test_finds_the_split_accelerate_leaves_on_the_table():
    # accelerate keeps room for the largest layer (400 B) on device 0, so it gives up;
    # 300 + 300 on device 0 and 400 on device 1 fits exactly.
    model = _stack([75, 75, 100])
    size = size_module(model)
    budgets = {0: 600, 1: 400}
    assert "disk" in infer_auto_device_map(model, max_memory=dict(budgets), no_split_module_classes=["Block"]).values()
    device_map = split_device_map(model, budgets, size=size)
    assert device_map == {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1}
    _check(device_map, size, budgets)


def test_keeps_accelerates_answer_when_it_is_valid():
    model = _stack([100, 100, 100, 100])
    size = size_module(model)
    device_map = split_device_map(model, {0: 1200, 1: 1200}, size=size)
    assert device_map == {"blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1}  # accelerate's reserve


def test_overfull_accelerate_answer_is_replaced():
    # accelerate counts these bool blocks at 1/8 byte and would put all three on device 0 (1800 real bytes).
    model = Stack([800, 800, 50])
    model.blocks[0].inner.weight = nn.Parameter(torch.ones(800, dtype=torch.bool), requires_grad=False)
    model.blocks[1].inner.weight = nn.Parameter(torch.ones(800, dtype=torch.bool), requires_grad=False)
    size = size_module(model)
    budgets = {0: 1000, 1: 1000}
    naive = infer_auto_device_map(model, max_memory=dict(budgets), no_split_module_classes=["Block"])
    assert set(naive.values()) == {0}
    device_map = split_device_map(model, budgets, size=size)
    assert device_map == {"blocks.0": 0, "blocks.1": 1, "blocks.2": 1}


def test_budgets_are_visited_in_the_given_order_even_cpu_first():
    model = _stack([100, 100, 100])
    size = size_module(model)
    # accelerate keeps one block's room free on the first device it visits, here 1
    assert split_device_map(model, {1: 800, 0: 800}, size=size) == {"blocks.0": 1, "blocks.1": 0, "blocks.2": 0}
    assert split_device_map(model, {"cpu": 400, 0: 800}, size=size) == {"blocks.0": "cpu", "blocks.1": 0, "blocks.2": 0}


def test_whole_fit_on_the_first_device_is_the_root_key():
    model = _stack([10, 10])
    assert split_device_map(model, {0: 1000, 1: 1000}, size=size_module(model)) == {"": 0}


def test_impossible_splits_are_none():
    model = _stack([100, 100, 100])
    size = size_module(model)
    assert split_device_map(model, {0: 1199, 1: 0}, size=size) is None  # total too large
    assert split_device_map(model, {0: 399, 1: 399, 2: 399, 3: 399}, size=size) is None  # no block fits
    assert split_device_map(model, {0: 500, 1: 500}, size=size) is None  # fits in sum, not in blocks
    assert split_device_map(model, {}, size=size) is None


def test_tied_units_stay_together():
    model = Stack([100, 100, 100, 100])
    model.blocks[3].inner.weight = model.blocks[0].inner.weight  # blocks.3 costs nothing but shares blocks.0
    size = size_module(model)
    assert split_device_map(model, {0: 400, 1: 800}, size=size) is None  # any cut separates 0 from 3
    assert split_device_map(model, {0: 1200, 1: 800}, size=size) == {"": 0}


def test_merge_to_prefixes():
    assignment = {"a.0": 0, "a.1": 0, "b.x.0": 0, "b.x.1": 1, "b.y": 1, "c": 1}
    assert merge_to_prefixes(assignment) == {"a": 0, "b.x.0": 0, "b.x.1": 1, "b.y": 1, "c": 1}
    assert merge_to_prefixes({"a": 2, "b": 2}) == {"": 2}


def test_mixed_model_never_cuts_a_block():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    class Mixed(nn.Module):
        _no_split_modules = ["Inner"]

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))
            self.stem = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
            self.blocks = nn.ModuleList(Inner() for _ in range(5))
            self.register_buffer("table", torch.zeros(32))

    model = Mixed()
    size = size_module(model)
    for room in range(size.largest_unit, size.total + 1, 97):
        budgets = {0: room, 1: room, 2: room}
        device_map = split_device_map(model, budgets, size=size)
        assert (device_map is not None) == _feasible([u.bytes for u in size.split_units], budgets)
        if device_map is not None:
            _check(device_map, size, budgets)


@settings(max_examples=300, deadline=None)
@given(
    numels=st.lists(st.integers(1, 64), min_size=1, max_size=7),
    budgets=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    order=st.permutations(range(3)),
)
def test_split_is_found_exactly_when_one_exists(numels, budgets, order):
    model = _stack(numels)
    size = size_module(model)
    devices = [d for d in order if d < len(budgets)]
    room = {device: budgets[device] for device in devices}
    device_map = split_device_map(model, room, size=size)
    assert (device_map is not None) == _feasible([4 * n for n in numels], room)
    if device_map is not None:
        placed = _check(device_map, size, room)
        seen = [devices.index(placed[f"blocks.{i}"]) for i in range(len(numels))]
        assert seen == sorted(seen)  # in order: data crosses each device boundary once

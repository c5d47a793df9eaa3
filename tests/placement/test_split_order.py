"""Splits cut in execution order: a module split over k devices enters each device once per forward where its
structure allows (structural order without example inputs, a traced order with them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate import init_empty_weights
from torch import nn

import placement
from placement.sizing import size_module
from placement.splitting import split_device_map
from placement.unit_order import device_crossings, order_units, record_module_order, trace_module_order


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(x)


class Shuffled(nn.Module):
    """Runs its blocks in an order registration does not show (0, 2, 1, 3): only a trace can tell."""

    _no_split_modules = ["Block"]
    RUN_ORDER = (0, 2, 1, 3)

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))

    def forward(self, x):
        for index in self.RUN_ORDER:
            x = self.blocks[index](x)
        return x


def calls_of(module: nn.Module, *args) -> list[str]:
    with record_module_order(module, every_call=True) as calls:
        placement.estimate_activations(module, args)
    return calls


def two_rooms(size) -> dict[int, int]:
    return {0: size.total // 2 + size.largest_unit, 1: size.total // 2 + size.largest_unit}


def test_a_traced_order_makes_a_two_device_split_cross_once():
    with init_empty_weights():
        module = Shuffled()
    x = torch.empty(2, 16, device="meta")
    size = size_module(module)
    calls = calls_of(module, x)
    structural = split_device_map(module, two_rooms(size), size=size)
    assert device_crossings(calls, structural) == 3  # blocks 0,1 | 2,3 run as 0 | 2 | 1 | 3
    traced = dataclasses.replace(size, split_units=order_units(size.split_units, trace_module_order(module, (x,))))
    device_map = split_device_map(module, two_rooms(size), size=traced)
    assert device_crossings(calls, device_map) == 1
    assert device_map["blocks.0"] == device_map["blocks.2"] == 0 and device_map["blocks.3"] == 1


def test_plan_cuts_splits_in_the_module_order_it_is_given():
    with init_empty_weights():
        module = Shuffled()
    size = size_module(module)
    order = trace_module_order(module, (torch.empty(2, 16, device="meta"),))
    budget = size.total // 2 + size.largest_unit
    plan = placement.plan({"denoiser": module}, max_memory={0: f"{budget}B", 1: f"{budget}B"}, module_order={"denoiser": order})
    component = plan.components["denoiser"]
    assert component.kind.value == "split"
    assert device_crossings(calls_of(module, torch.empty(2, 16, device="meta")), component.device_map) == 1
    assert component.execution_device == 0  # where the first block to run lives


def test_order_units_keeps_untraced_units_after_their_structural_predecessor():
    units = size_module(Shuffled()).split_units
    ordered = order_units(units, ["blocks.3", "blocks.0"])
    assert [unit.path for unit in ordered] == ["blocks.3", "blocks.0", "blocks.1", "blocks.2"]


def test_sd15_unet_split_over_two_devices_crosses_once_without_example_inputs():
    """diffusers registers UNet2DConditionModel's mid_block after up_blocks; cut in registration order its split
    over two GPUs goes down(0) -> mid(1) -> up(0) -> up(1). The structural order puts mid before up."""
    diffusers = pytest.importorskip("diffusers")
    config = dict(block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=4,
                  norm_num_groups=8, sample_size=16,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    with init_empty_weights():
        unet = diffusers.UNet2DConditionModel(**config)
    inputs = (torch.empty(1, 4, 16, 16, device="meta"), torch.tensor(1.0, device="meta"),
              torch.empty(1, 7, 32, device="meta"))
    calls = calls_of(unet, *inputs)
    size = size_module(unet)
    device_map = split_device_map(unet, two_rooms(size), size=size)
    assert set(device_map.values()) == {0, 1}
    assert device_crossings(calls, device_map) == 1
    assert [key for key in device_map if key.startswith("mid_block")] and device_map["mid_block"] == 0


def test_the_pipeline_planner_records_each_components_call_order_during_its_activation_estimate():
    from pipeline_fixtures import tiny_flux_on_meta
    from pipelines.loading.planning import call_activations, modules_and_edges

    pipe = tiny_flux_on_meta()
    modules, _ = modules_and_edges(pipe)
    module_order: dict[str, list[str]] = {}
    peaks = call_activations(pipe, modules, {"height": 64, "width": 64}, module_order=module_order)
    assert set(module_order) == set(peaks) == set(modules)
    blocks = [path for path in module_order["transformer"] if path.count(".") == 1 and "blocks" in path]
    assert blocks and all(not hasattr(m, "_forward_pre_hooks") or not m._forward_pre_hooks
                          for m in modules["transformer"].modules())  # the recording hooks are gone


def test_blocks_the_estimate_replays_are_recorded_in_order_and_splits_cut_alike(monkeypatch, tmp_path):
    """The block memo replays identical blocks (their submodules never run): the recorded order and the split
    cut in it are those of a full run."""
    from pipeline_fixtures import deeper_flux_folder
    from pipelines import Pipeline
    from pipelines.loading.planning import call_activations, modules_and_edges
    from placement.activations.memo import CACHE_ENV, MEMO_ENV, _Record

    monkeypatch.setenv(CACHE_ENV, "0")
    replays = []
    replay = _Record.replay
    monkeypatch.setattr(_Record, "replay", lambda self, *a: replays.append(1) or replay(self, *a))
    # Two identical single-stream blocks, for the memo to replay the second.
    pipe = Pipeline.from_pretrained(deeper_flux_folder(tmp_path / "flux", num_single_layers=2), progress=False)
    modules, _ = modules_and_edges(pipe)
    transformer = modules["transformer"]
    plans, orders = [], []
    for memo in ("1", "0"):
        monkeypatch.setenv(MEMO_ENV, memo)
        module_order: dict[str, list[str]] = {}
        call_activations(pipe, modules, {"height": 64, "width": 64}, module_order=module_order)
        orders.append(module_order)
        rooms = {device: f"{room}B" for device, room in two_rooms(size_module(transformer)).items()}
        plans.append(placement.plan({"transformer": transformer}, max_memory=rooms,
                                    module_order={"transformer": module_order["transformer"]}))
    assert replays and orders[0] == orders[1] and "single_transformer_blocks.1.proj_mlp" in orders[0]["transformer"]
    assert plans[0].components["transformer"].kind.value == "split"
    assert plans[0].device_map == plans[1].device_map

"""apply_component_plan: which runtime each placement kind gets, on virtual accelerators (CPU-backed)."""

import pytest
import torch
from torch import nn

from hooks.group_offload.offload import GroupOffloadHook
from hooks.hook_utils import find_hooks
from hooks.techniques import apply_component_plan
from hooks.techniques import Technique, techniques_on
from placement.plan_schema import ComponentPlan, PlacementKind

from resident_weights import place_resident_weights
from same_output import assert_same_output


@pytest.fixture
def one_virtual_gpu(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)]), nn.Linear(8, 4)).eval()


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = model()

    def forward(self, x):
        x = self.inner[0](x)
        return self.inner[2](self.inner[1][0](x))


def offloaded(device_map: dict) -> ComponentPlan:
    return ComponentPlan(name="m", kind=PlacementKind.OFFLOADED, devices=sorted(set(device_map.values()), key=str),
                         execution_device=0, bytes=0, device_map=device_map, placed_bytes={})


def test_an_offloaded_plan_with_a_resident_part_keeps_it_resident_and_streams_the_rest(one_virtual_gpu):
    module, expected_input = Chain(), torch.randn(2, 8)
    with torch.no_grad():
        expected = module(expected_input)
    device_map = {"inner.0": 0, "inner.1": "cpu", "inner.2": "cpu"}
    apply_component_plan(place_resident_weights(module, device_map), offloaded(device_map))
    # Not group offloading: it would take the GPU-resident inner.0 into its CPU store too.
    assert list(find_hooks(module, GroupOffloadHook)) == []
    assert Technique.DEVICE_MAP in techniques_on(module)
    with torch.no_grad():
        assert_same_output(module(expected_input), expected)


def test_an_offloaded_plan_with_every_weight_in_cpu_ram_is_group_offloaded(one_virtual_gpu):
    module = Chain()
    apply_component_plan(module, offloaded({"": "cpu"}))
    assert list(find_hooks(module, GroupOffloadHook)) != []

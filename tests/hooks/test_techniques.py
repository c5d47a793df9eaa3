"""The technique table: each technique names what it refuses, one check enforces it, every pair is covered."""

import itertools

import pytest
import torch
from torch import nn

from hooks import (
    GroupOffloadingConfig,
    LayerwiseCastingConfig,
    ModelOffloadConfig,
    OffloadConflictError,
    SequentialOffloadConfig,
    Technique,
    apply_group_offloading,
    apply_layerwise_casting,
    apply_model_cpu_offload,
    apply_sequential_cpu_offload,
    remove_group_offloading,
    remove_layerwise_casting,
    remove_model_cpu_offload,
    remove_sequential_cpu_offload,
)
from hooks.dispatch import dispatch, undispatch
from hooks.layerwise_casting import DEFAULT_SKIP_MODULES_CLASSES
from hooks.techniques import REFUSES, techniques_on


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]), nn.Linear(8, 4))


CASTING = LayerwiseCastingConfig(storage_dtype=torch.bfloat16, compute_dtype=torch.float32,
                                 skip_modules_pattern=(), skip_modules_classes=DEFAULT_SKIP_MODULES_CLASSES)
APPLY = {
    Technique.DEVICE_MAP: lambda m: dispatch(m, {"0": "cpu", "1": "cpu", "2": "cpu"}, execution_device="cpu"),
    Technique.MODEL_OFFLOAD: lambda m: apply_model_cpu_offload([m], ModelOffloadConfig(execution_device="cpu")),
    Technique.SEQUENTIAL_OFFLOAD: lambda m: apply_sequential_cpu_offload(m, SequentialOffloadConfig(execution_device="cpu")),
    Technique.GROUP_OFFLOAD: lambda m: apply_group_offloading(m, GroupOffloadingConfig(onload_device="cpu")),
    Technique.LAYERWISE_CASTING: lambda m: apply_layerwise_casting(m, CASTING),
}
REMOVE = {
    Technique.DEVICE_MAP: undispatch,
    Technique.MODEL_OFFLOAD: remove_model_cpu_offload,
    Technique.SEQUENTIAL_OFFLOAD: remove_sequential_cpu_offload,
    Technique.GROUP_OFFLOAD: remove_group_offloading,
    Technique.LAYERWISE_CASTING: remove_layerwise_casting,
}


@pytest.mark.parametrize("technique", list(Technique))
def test_each_technique_is_recognised_on_the_tree_and_removed(technique):
    model = make()
    APPLY[technique](model)
    assert technique in techniques_on(model)
    REMOVE[technique](model)
    assert techniques_on(model) == {}


@pytest.mark.parametrize("present, applying", [pair for pair in itertools.permutations(Technique, 2)
                                               if pair[1] is not Technique.DEVICE_MAP])
def test_the_table_decides_every_pair(present, applying):
    model = make()
    APPLY[present](model)
    if present in REFUSES[applying]:
        with pytest.raises(OffloadConflictError, match=f"already has {present.value}.*Remove it first"):
            APPLY[applying](model)
    else:  # the pair combines: both are on the tree and the model still runs
        APPLY[applying](model)
        assert {present, applying} <= set(techniques_on(model))
        with torch.no_grad():
            assert model[0](torch.ones(1, 8)).shape == (1, 8)

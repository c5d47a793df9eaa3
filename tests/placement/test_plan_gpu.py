"""On a machine with a GPU: detected budgets come from the free memory, minus the documented margin."""

import warnings

import pytest
import torch

import placement
from placement import PlacementKind
from placement.budgets import apply_accelerator_margin
from synthetic import whole

pytestmark = pytest.mark.gpu


def test_detected_budgets_read_free_gpu_memory():
    free_before = torch.cuda.mem_get_info(0)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a GPU is present: no "degrades to cpu" warning
        plan = placement.plan({"encoder": whole(0.5), "denoiser": whole(1, 4)})
    free_after = torch.cuda.mem_get_info(0)[0]
    gpu = plan.device(0)
    assert gpu.detected and plan.accelerators == list(range(torch.cuda.device_count()))
    low, high = sorted([apply_accelerator_margin(free_before), apply_accelerator_margin(free_after)])
    assert low - 64 * 1024**2 <= gpu.budget <= high + 64 * 1024**2
    assert {c.kind for c in plan.components.values()} == {PlacementKind.WHOLE}
    assert plan.strategy == "balanced" and not plan.warnings


def test_single_device_strategy_on_a_real_gpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = placement.plan({"vae": whole(0.25)}, strategy="cuda")
    assert plan.device_map == {"vae": 0}

"""A balanced load over GPU 0 whose budget forces a component to be offloaded (block-level group offloading
from CPU RAM) gives the images of a plain all-on-GPU run. The run needs CUDA (skipped without it); finding the
budget is planning only and is checked everywhere."""

from __future__ import annotations

import pytest
import torch

from pipelines import Pipeline

from pipeline_fixtures import generate, module_components, save_preset

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


def budget_that_offloads(folder) -> dict:
    """The largest GPU 0 budget (in 1/40ths of the pipeline) under which the plan offloads some component."""
    sizes = Pipeline.plan_placement(folder, max_memory={0: "1GiB"}).components.values()
    total = sum(component.bytes for component in sizes)
    for step in range(1, 40):
        max_memory = {0: f"{total - step * total // 40}B", "cpu": "8GiB"}
        plan = Pipeline.plan_placement(folder, max_memory=max_memory)
        if any(component.kind.value == "offloaded" and component.device_map == {"": "cpu"}  # wholly in RAM
               for component in plan.components.values()):
            return max_memory
    raise AssertionError("no GPU 0 budget makes the planner offload a component")


def test_some_budget_on_gpu0_offloads_a_component(tmp_path):
    folder, _ = save_preset(tmp_path / "tiny-flux")
    plan = Pipeline.plan_placement(folder, max_memory=budget_that_offloads(folder))
    offloaded = [c for c in plan.components.values() if c.kind.value == "offloaded"]
    assert offloaded and all(c.execution_device == 0 for c in offloaded)
    assert any(c.device_map == {"": "cpu"} for c in offloaded)  # others may keep blocks resident (issue 18)


@pytest.mark.gpu
def test_offloaded_components_on_gpu0_match_a_plain_gpu_run(tmp_path):
    folder, pipe = save_preset(tmp_path / "tiny-flux")
    expected = generate(pipe.to("cuda"), height=64, width=64)
    loaded = Pipeline.from_pretrained(folder, device_map="balanced", max_memory=budget_that_offloads(folder),
                                      progress=False)
    for name, component in loaded.placement_plan.components.items():
        weights = {p.device.type for p in loaded.components[name].parameters()}
        if component.kind.value == "offloaded" and component.device_map == {"": "cpu"}:
            assert loaded.hf_device_map[name] == "cpu" and weights == {"cpu"}  # in RAM between calls
        elif component.kind.value == "whole":
            assert loaded.hf_device_map[name] == 0 and weights == {"cuda"}
    torch.testing.assert_close(generate(loaded, height=64, width=64), expected, atol=1e-3, rtol=0)
    loaded.reset_device_map()
    assert {p.device.type for m in module_components(loaded).values() for p in m.parameters()} == {"cpu"}


@pytest.mark.gpu
def test_model_offload_leaves_nothing_on_the_gpu_after_a_call(tmp_path):
    folder, _ = save_preset(tmp_path / "tiny-flux")
    pipe = Pipeline.from_pretrained(folder, progress=False)
    pipe.enable_model_cpu_offload(0)
    generate(pipe, height=64, width=64)
    assert {p.device.type for m in module_components(pipe).values() for p in m.parameters()} == {"cpu"}
    pipe.reset_device_map()

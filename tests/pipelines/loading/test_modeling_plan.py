"""ModelMixin.plan_placement and from_pretrained(device_map=...) through the one planner: a one-component Plan
(explain, fallbacks, kinds), kept on the model as `placement_plan`, loaded by the pipeline runtime."""

from __future__ import annotations

import json

import pytest
import torch

import pipelines.loading.placing as placing
from checkpoint_models import TinyModel, saved_bytes, tiny_ids, tiny_model
from placement import Plan
from placement.devices import accelerators_present
from placement.errors import InvalidDeviceError
from placement.plan_schema import PlacementKind
from placement.sizing import size_module
from same_output import assert_same_output

no_gpu = pytest.mark.skipif(accelerators_present() > 0, reason="checks the refusal on a machine without GPUs")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan") / "tiny"
    model = tiny_model(depth=6)
    model.save_pretrained(folder, max_shard_size=4000)
    return model, folder


def hooked(model):
    return [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")]


def test_plan_placement_is_a_one_component_plan_with_explain(saved):
    model, folder = saved
    size = saved_bytes(model)
    plan = TinyModel.plan_placement(folder, device_map="balanced", max_memory={0: f"{size}B", 1: f"{size}B"})
    assert isinstance(plan, Plan) and list(plan.components) == ["TinyModel"]
    component = plan.components["TinyModel"]
    assert component.kind is PlacementKind.SPLIT and component.devices == [0, 1]  # accelerate's even split
    assert plan.fallbacks[0].component == "TinyModel"
    assert "TinyModel" in plan.explain() and plan.strategy == "balanced"
    assert plan.accelerators == [0, 1]


def test_plan_placement_reads_no_weights(saved, tmp_path):
    model, folder = saved
    configs_only = tmp_path / "configs"
    configs_only.mkdir()
    (configs_only / "config.json").write_text((folder / "config.json").read_text())
    from_configs = TinyModel.plan_placement(configs_only, device_map="sequential", max_memory={0: "1GiB"})
    with_weights = TinyModel.plan_placement(folder, device_map="sequential", max_memory={0: "1GiB"})
    assert from_configs.components["TinyModel"].device_map == {"": 0}
    assert from_configs.components["TinyModel"].bytes == with_weights.components["TinyModel"].bytes


def test_the_loaded_model_keeps_the_plan_it_followed(saved):
    model, folder = saved
    budget = {"cpu": "1GB"}
    planned = TinyModel.plan_placement(folder, device_map="auto", max_memory=budget)
    loaded = TinyModel.from_pretrained(folder, device_map="auto", max_memory=budget, progress=False)
    assert loaded.placement_plan == planned
    assert loaded.hf_device_map == planned.component_device_map("TinyModel") == {"": "cpu"}
    ids = tiny_ids(model.config)
    assert_same_output(loaded(ids), model(ids))


@pytest.mark.parametrize("device_map", ["auto", "balanced", "sequential", "cpu", {"": "cpu"}])
def test_cpu_means_what_it_means_for_a_pipeline_component(saved, device_map):
    model, folder = saved
    loaded = TinyModel.from_pretrained(folder, device_map=device_map, max_memory={"cpu": "1GB"}, progress=False)
    component = loaded.placement_plan.components["TinyModel"]
    assert component.kind is PlacementKind.CPU and component.execution_device == "cpu"
    assert {t.device.type for t in loaded.state_dict().values()} == {"cpu"}


def test_single_device_loads_without_hooks_and_strategies_with_the_component_runtime(saved):
    _, folder = saved
    single = TinyModel.from_pretrained(folder, device_map="cpu", progress=False)
    assert hooked(single) == []
    strategy = TinyModel.from_pretrained(folder, device_map="auto", max_memory={"cpu": "1GB"}, progress=False)
    assert "" in hooked(strategy)  # the hooks `apply_component_plan` gives a pipeline component of this kind


def test_cpu_and_disk_budget_is_a_disk_component_served_from_the_checkpoint(saved, tmp_path):
    model, folder = saved
    budget = int(0.4 * saved_bytes(model))
    loaded = TinyModel.from_pretrained(folder, device_map="sequential", max_memory={"cpu": f"{budget}B"},
                                       offload_folder=tmp_path, progress=False)
    component = loaded.placement_plan.components["TinyModel"]
    assert component.kind is PlacementKind.DISK and set(component.devices) == {"cpu", "disk"}
    assert component.placed_bytes["cpu"] <= budget
    ids = tiny_ids(model.config)
    assert_same_output(loaded(ids), model(ids))


@no_gpu
@pytest.mark.parametrize(
    ("device_map", "fraction", "kind"),
    [("balanced", 1.0, PlacementKind.SPLIT), ("sequential", 0.5, PlacementKind.OFFLOADED),
     ({"": 0, "blocks.3": "disk"}, 1.0, PlacementKind.DISK), (1, 2.0, PlacementKind.WHOLE)],
)
def test_plans_for_absent_gpus_are_made_and_their_loads_refused(saved, device_map, fraction, kind, tmp_path):
    model, folder = saved
    size = saved_bytes(model)
    budgets = {0: f"{int(fraction * size)}B", 1: f"{int(fraction * size)}B", "cpu": f"{size}B"}
    plan = TinyModel.plan_placement(folder, device_map=device_map, max_memory=budgets, offload_folder=tmp_path)
    assert plan.components["TinyModel"].kind is kind
    # a strategy is refused once planned; a device map naming the GPU before anything is built
    refused = r"on accelerator\(s\) \[\d.*this machine has 0|asks for GPU \d .*this machine has no accelerator"
    with pytest.raises(InvalidDeviceError, match=refused):
        TinyModel.from_pretrained(folder, device_map=device_map, max_memory=budgets, offload_folder=tmp_path,
                                  progress=False)


def test_a_failed_load_leaves_no_hooks_and_nothing_loaded(saved, monkeypatch, tmp_path):
    _, folder = saved
    seen = []
    real = placing.apply_component_plan

    def apply_then_fail(module, component, **kwargs):
        real(module, component, **kwargs)
        seen.append(module)
        assert hooked(module)  # the hooks were attached before the failure
        raise RuntimeError("simulated failure after dispatch")

    monkeypatch.setattr(placing, "apply_component_plan", apply_then_fail)
    with pytest.raises(RuntimeError, match="simulated failure"):
        TinyModel.from_pretrained(folder, device_map={"": "cpu", "blocks.2": "disk"}, offload_folder=tmp_path,
                                  progress=False)
    (module,) = seen
    assert hooked(module) == []
    assert {t.device.type for t in module.state_dict().values()} == {"meta"}
    assert module.hf_device_map is None


def test_plan_json_round_trips_and_sizes_follow_torch_dtype(saved):
    _, folder = saved
    plan = TinyModel.plan_placement(folder, device_map="auto", max_memory={0: "1GiB"}, torch_dtype=torch.float16)
    again = Plan.from_json(plan.to_json())
    # The plan states the dtype it assumed, and why: "float16 (requested; float32 kept: norm_out)".
    assert again == plan and json.loads(plan.to_json())["components"]["TinyModel"]["dtype"].startswith("float16 ")
    fp32 = TinyModel.plan_placement(folder, device_map="auto", max_memory={0: "1GiB"})
    assert plan.components["TinyModel"].bytes < fp32.components["TinyModel"].bytes
    with torch.device("meta"):
        meta = TinyModel(TinyModel.config_class(depth=6))
    assert fp32.components["TinyModel"].bytes == size_module(meta).total


@pytest.mark.gpu
def test_offloaded_model_runs_with_group_offloading_on_the_gpu(saved):
    # accelerate streamed each leaf of the CPU part; a model component offloaded to CPU RAM and executed on an
    # accelerator now gets the pipeline runtime for that kind: block-level group offloading.
    model, folder = saved
    size = saved_bytes(model)
    loaded = TinyModel.from_pretrained(folder, device_map="sequential", max_memory={0: size // 2, "cpu": size},
                                       progress=False)
    component = loaded.placement_plan.components["TinyModel"]
    assert component.kind is PlacementKind.OFFLOADED and component.execution_device == 0
    from hooks.group_offload import GroupOffloadHook
    from hooks.hook_utils import has_hook

    assert has_hook(loaded, GroupOffloadHook)
    ids = tiny_ids(model.config)
    assert torch.allclose(loaded(ids.to("cuda:0")).cpu(), model(ids), atol=1e-5)

"""ModelMixin.from_pretrained with device maps: strategies, single devices, dicts, cpu and disk offload.

Planned by `placement.plan(..., scope="model")` and loaded by the pipeline runtime (see test_modeling_plan.py)."""

from __future__ import annotations

import pytest
import torch

from checkpoint_models import Block, PlainConfig, PlainModel, TinyModel, saved_bytes, tiny_ids, tiny_model
from pipeline_fixtures import holds_no_copy
from same_output import assert_same_output


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dm") / "tiny"
    model = tiny_model(depth=6)
    model.save_pretrained(folder, max_shard_size=4000)
    return model, folder


def no_block_is_cut(model, device_map) -> bool:
    blocks = [path for path, m in model.named_modules() if isinstance(m, Block)]
    return not any(key.startswith(f"{block}.") for key in device_map for block in blocks)


def hooked(model):
    return [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")]


def test_auto_with_40_percent_cpu_offloads_to_disk_and_matches(saved, tmp_path):
    model, folder = saved
    budget = int(0.4 * saved_bytes(model))
    loaded = TinyModel.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": f"{budget}B"}, offload_folder=tmp_path / "off", progress=False
    )
    devices = set(loaded.hf_device_map.values())
    assert "disk" in devices, loaded.hf_device_map
    assert no_block_is_cut(loaded, loaded.hf_device_map)
    resident = sum(t.numel() * t.element_size() for t in loaded.state_dict().values() if t.device.type != "meta")
    assert resident <= budget + 1024  # what is not on disk fits the cpu budget (plus the int buffer)
    ids = tiny_ids(model.config)
    assert_same_output(loaded(ids), model(ids))
    assert holds_no_copy(tmp_path / "off", folder)  # served from the checkpoint (pinned by hard links)


@pytest.mark.parametrize("strategy", ["auto", "balanced", "balanced_low_0", "sequential"])
def test_every_strategy_loads_on_a_cpu_budget(saved, strategy):
    model, folder = saved
    loaded = TinyModel.from_pretrained(folder, device_map=strategy, max_memory={"cpu": "1GB"}, progress=False)
    assert set(loaded.hf_device_map.values()) == {"cpu"}
    ids = tiny_ids(model.config)
    assert_same_output(loaded(ids), model(ids))


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu")])
def test_single_device_places_everything_without_hooks(saved, spec):
    model, folder = saved
    loaded = TinyModel.from_pretrained(folder, device_map=spec, progress=False)
    assert loaded.hf_device_map == {"": "cpu"}
    assert hooked(loaded) == []
    assert loaded.head.weight is loaded.embed.weight


def test_dict_map_with_disk_writes_nothing_to_the_offload_folder(saved, tmp_path):
    model, folder = saved
    device_map = {"embed": "cpu", "blocks.0": "disk", "blocks.1": "cpu", "blocks": "disk", "norm_out": "cpu",
                  "head": "cpu", "steps": "cpu"}
    # offload_folder permits the disk (as in accelerate); no byte is written there: the checkpoint serves it (its
    # file hard-linked there, so that a save over the folder cannot change what this model reads).
    loaded = TinyModel.from_pretrained(folder, device_map=device_map, offload_folder=tmp_path / "off", progress=False)
    assert holds_no_copy(tmp_path / "off", folder)
    flat = {**device_map, **{f"blocks.{i}": "disk" for i in range(2, 6)}}
    del flat["blocks"]  # nested keys are flattened: the longest prefix wins
    assert loaded.hf_device_map == flat
    assert loaded.blocks[1].fc1.weight.device.type == "cpu"
    assert loaded.blocks[0].fc1.weight.device.type == "meta"
    assert torch.equal(loaded.blocks[0].gate, model.blocks[0].gate)  # persistent buffer of a disk module
    ids = tiny_ids(model.config)
    assert_same_output(loaded(ids), model(ids))


def test_offloaded_load_honours_torch_dtype(saved, tmp_path):
    model, folder = saved
    loaded = TinyModel.from_pretrained(
        folder, device_map="auto", torch_dtype=torch.bfloat16,
        max_memory={"cpu": f"{int(0.2 * saved_bytes(model))}B"}, offload_folder=tmp_path, progress=False,
    )
    assert "disk" in loaded.hf_device_map.values()
    assert loaded.norm_out.weight.dtype == torch.float32
    ids = tiny_ids(model.config)
    reference = TinyModel.from_pretrained(folder, torch_dtype=torch.bfloat16, progress=False)
    assert_same_output(loaded(ids), reference(ids))


def test_class_without_no_split_modules_works_with_auto(tmp_path):
    torch.manual_seed(0)
    model = PlainModel(PlainConfig()).eval()
    model.save_pretrained(tmp_path / "plain")
    loaded = PlainModel.from_pretrained(
        tmp_path / "plain", device_map="auto", max_memory={"cpu": "1MB"}, offload_folder=tmp_path, progress=False
    )
    assert len(loaded.hf_device_map) == 1  # placed whole
    x = torch.randn(3, 8)
    assert_same_output(loaded(x), model(x))


@pytest.mark.gpu
def test_auto_on_an_accelerator_with_cpu_and_disk_offload(saved, tmp_path):
    model, folder = saved
    size = saved_bytes(model)
    loaded = TinyModel.from_pretrained(
        folder, device_map="auto", max_memory={0: f"{int(0.4 * size)}B", "cpu": f"{int(0.3 * size)}B"},
        offload_folder=tmp_path, progress=False,
    )
    assert {0, "cpu", "disk"} <= set(loaded.hf_device_map.values()), loaded.hf_device_map
    assert no_block_is_cut(loaded, loaded.hf_device_map)
    # A component with a disk part is a "disk" component of the one runtime (weights served from the
    # checkpoint); one with only CPU RAM beside the GPU would be "offloaded" and group-offloaded instead of
    # accelerate's per-leaf streaming (test_modeling_plan.py checks that).
    assert loaded.placement_plan.components["TinyModel"].kind.value == "disk"
    ids = tiny_ids(model.config)
    out = loaded(ids.to("cuda:0"))
    assert torch.allclose(out.cpu(), model(ids), atol=1e-5)


@pytest.mark.gpu
def test_single_accelerator_loads_straight_to_it(saved):
    model, folder = saved
    loaded = TinyModel.from_pretrained(folder, device_map="cuda", torch_dtype=torch.float16, progress=False)
    assert loaded.hf_device_map == {"": 0}
    assert loaded.blocks[0].fc1.weight.device == torch.device("cuda:0")
    assert loaded.norm_out.weight.dtype == torch.float32


def test_a_disk_offloaded_model_saves_as_it_is_placed(saved, tmp_path):
    model, folder = saved
    loaded = TinyModel.from_pretrained(folder, device_map={"": "cpu", "blocks.1": "disk"}, offload_folder=tmp_path,
                                       progress=False)
    loaded.save_pretrained(tmp_path / "copy")  # the disk weights read from the checkpoint, shard by shard
    assert loaded.blocks[1].fc1.weight.is_meta  # still placed: nothing was brought back
    again = TinyModel.from_pretrained(tmp_path / "copy", progress=False)
    ids = tiny_ids(model.config)
    assert_same_output(again(ids), model(ids))
    assert_same_output(loaded(ids), model(ids))

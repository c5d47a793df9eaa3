"""A load whose plan homes weights on "disk" measures the read speed of the checkpoint's drive once (the plan's
seconds per call then use it); a load without disk, and a plan made without loading, read nothing to measure."""

from __future__ import annotations

import pytest

from checkpoint_models import TinyModel, saved_bytes, tiny_model
from pipelines import TextToImagePipeline
from placement.transfers import inputs as disk_speed
from placement.plan_schema import DEFAULT_DISK_SOURCE


@pytest.fixture
def saved(tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    model = tiny_model(depth=6)
    model.save_pretrained(folder, max_shard_size=4000)
    monkeypatch.setattr(disk_speed, "_MEASURED", {})  # once per drive and process: a fresh process here
    return model, folder


def test_a_load_with_disk_measures_the_checkpoint_drive_once(saved, tmp_path, monkeypatch):
    model, folder = saved
    read = []
    real = disk_speed._measure
    monkeypatch.setattr(disk_speed, "_measure", lambda path: read.append(path) or real(path))
    options = dict(device_map="auto", max_memory={"cpu": f"{int(0.4 * saved_bytes(model))}B"},
                   offload_folder=tmp_path / "off", progress=False)
    loaded = TinyModel.from_pretrained(folder, **options)
    assert "disk" in loaded.hf_device_map.values()
    plan = loaded.placement_plan
    assert plan.disk_read_bandwidth_source.startswith("measured: ") and plan.disk_read_bandwidth > 0
    assert len(read) == 1 and str(read[0]).startswith(str(folder))
    again = TinyModel.from_pretrained(folder, **options)
    assert len(read) == 1 and again.placement_plan.disk_read_bandwidth == plan.disk_read_bandwidth


def test_a_load_without_disk_and_a_plan_alone_measure_nothing(saved, tmp_path, monkeypatch):
    model, folder = saved
    monkeypatch.setattr(disk_speed, "_measure", lambda path: pytest.fail(f"measured {path}"))
    loaded = TinyModel.from_pretrained(folder, device_map="auto", max_memory={"cpu": "1GiB"}, progress=False)
    assert loaded.placement_plan.disk_read_bandwidth_source == DEFAULT_DISK_SOURCE
    planned = TinyModel.plan_placement(folder, device_map="auto", offload_folder=tmp_path / "off",
                                       max_memory={"cpu": f"{int(0.4 * saved_bytes(model))}B"})
    assert "disk" in planned.device_map.values() and planned.disk_read_bandwidth_source == DEFAULT_DISK_SOURCE


def test_a_pipeline_load_with_disk_measures_too(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_speed, "_MEASURED", {})
    folder = tmp_path / "pipe"
    TextToImagePipeline.from_preset("tiny-dit", seed=0).save_pretrained(folder)
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")  # a dict map with no accelerator degrades to "cpu"
    device_map = {"text_encoder": 0, "text_encoder_2": 0, "denoiser": "disk", "vae": 0}
    pipe = TextToImagePipeline.from_pretrained(folder, device_map=device_map, offload_folder=tmp_path / "off",
                                               progress=False)
    assert any(c.placed_bytes.get("disk") for c in pipe.placement_plan.components.values())
    assert pipe.placement_plan.disk_read_bandwidth_source.startswith("measured: ")
    assert pipe.placement_plan.disk_read_bandwidth > 0

"""A load's arguments are resolved once, at its entry, into a frozen LoadRequest: device_map as what it is,
torch_dtype validated once (its keys checked in one place, with one message), the accelerators detected once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoint_models import TinyModel, tiny_model
from own_fixtures import save_preset
from pipelines import TextToImagePipeline
from pipelines.loading.request import (
    DeviceMapKind,
    DeviceMapRequest,
    DtypeRequest,
    LoadOptions,
    Scope,
    resolve_request,
)
from placement.errors import PlanError


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder, _ = save_preset(tmp_path_factory.mktemp("preset") / "p")
    return TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"})


@pytest.mark.parametrize(
    ("device_map", "kind"),
    [(None, DeviceMapKind.NONE), ({"vae": 0}, DeviceMapKind.PINS), ("balanced", DeviceMapKind.STRATEGY),
     ("auto", DeviceMapKind.STRATEGY), ("cuda:1", DeviceMapKind.SINGLE_DEVICE), (0, DeviceMapKind.SINGLE_DEVICE),
     (torch.device("cpu"), DeviceMapKind.SINGLE_DEVICE), ("cpu", DeviceMapKind.SINGLE_DEVICE)],
)
def test_device_map_is_interpreted_once_into_what_it_is(device_map, kind):
    interpreted = DeviceMapRequest.interpret(device_map)
    assert interpreted.kind is kind
    assert interpreted.hooks is (kind is not DeviceMapKind.SINGLE_DEVICE)


def test_a_saved_plan_is_read_once_whether_given_as_plan_or_as_its_json(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    for given in (plan, path, str(path)):
        interpreted = DeviceMapRequest.interpret(given)
        assert interpreted.kind is DeviceMapKind.SAVED_PLAN and interpreted.value == plan


def test_torch_dtype_values_are_checked_once_with_the_key_named():
    assert DtypeRequest.parse("bfloat16").for_component("vae") is torch.bfloat16
    request = DtypeRequest.parse({"vae": torch.float32, "default": "float16"})
    assert (request.for_component("vae"), request.for_component("denoiser")) == (torch.float32, torch.float16)
    assert DtypeRequest.parse(None).for_component("vae") is None
    with pytest.raises(PlanError, match=r"torch_dtype\['vae'\] = 'int8'"):
        DtypeRequest.parse({"vae": "int8"})


def test_torch_dtype_keys_are_checked_in_one_place_with_one_message():
    request = DtypeRequest.parse({"vea": torch.float16, "default": torch.float32})
    with pytest.raises(PlanError) as raised:
        request.check_names(["vae", "denoiser"], of="pipeline")
    assert str(raised.value) == (
        "torch_dtype names ['vea'], which are not module components of this pipeline; its module components are "
        "['denoiser', 'vae']. Fix the key(s), or use 'default' for every other component.")


def test_a_misspelt_torch_dtype_key_fails_before_anything_is_built(tmp_path, monkeypatch):
    import pipelines.loading.pipeline_loader as pipeline_loader

    folder, _ = save_preset(tmp_path / "p")
    monkeypatch.setattr(pipeline_loader, "build_from_source", lambda *a, **k: pytest.fail("built a component"))
    for entry in (TextToImagePipeline.from_pretrained, TextToImagePipeline.plan_placement):
        with pytest.raises(PlanError, match=r"\['vea'\].*'vae'"):
            entry(folder, device_map="balanced", torch_dtype={"vea": torch.float16})


def test_a_model_takes_a_torch_dtype_dict_keyed_by_its_class_name(tmp_path):
    tiny_model().save_pretrained(tmp_path / "m")
    model = TinyModel.from_pretrained(tmp_path / "m", torch_dtype={"TinyModel": torch.float16}, progress=False)
    assert model.blocks[0].fc1.weight.dtype is torch.float16
    assert TinyModel.from_pretrained(tmp_path / "m", torch_dtype={"default": "float16"},
                                     progress=False).blocks[0].fc1.weight.dtype is torch.float16
    with pytest.raises(PlanError, match=r"\['Tiny'\].*\['TinyModel'\]"):
        TinyModel.from_pretrained(tmp_path / "m", torch_dtype={"Tiny": torch.float16}, progress=False)


def test_the_request_is_frozen_and_carries_the_hub_options_and_accelerators(tmp_path, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    tiny_model().save_pretrained(tmp_path / "m")
    request = resolve_request(tmp_path / "m", LoadOptions(device_map="auto"), scope=Scope.MODEL)
    assert request.folder == tmp_path / "m" and request.accelerators.count == 2 and request.accelerators.virtual
    assert request.hub.revision is None and request.device_map.kind is DeviceMapKind.STRATEGY
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.folder = tmp_path
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.options.variant = "fp16"

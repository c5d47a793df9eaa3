"""Saving a diffusers pipeline we placed (a tiny StableDiffusionPipeline: a transformers CLIP text encoder, a
diffusers UNet and VAE) in every placement kind, before and after `reset_device_map()`, over two strict virtual
accelerators. diffusers' own `save_pretrained` writes the folder, inside our atomic save, with each model's weights
read from where they live; reset deletes the `hf_device_map` the placement set on the models (transformers' save
checks only that it exists) and gives components passed in back as they came."""

from __future__ import annotations

import pytest
import torch

from hooks import dispatch, measure_transfers
from pipelines import Pipeline
from placement.devices import torch_device

from placed_kinds import KINDS, hooks_and_placeholders, kind_plan
from test_diffusers_pipelines import build_sd, generate, has_hooks
from same_output import assert_same_output, same_output

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

BUDGETS = {0: "1GiB", 1: "1GiB", "cpu": "4GiB"}
PARTS = {"text_encoder": ("encoder", "embeddings"), "unet": ("down_blocks", "up_blocks")}


@pytest.fixture
def virtual(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny SD pipeline saved by diffusers, as diffusers loads it, and the images it makes."""
    root = tmp_path_factory.mktemp("sd-saves")
    torch.manual_seed(0)
    build_sd(root / "parts").save_pretrained(root / "sd")
    original = diffusers.StableDiffusionPipeline.from_pretrained(root / "sd")
    original.set_progress_bar_config(disable=True)
    return root / "sd", original, generate(original, "sd")


def load(folder, **kwargs):
    pipe = Pipeline.from_pretrained(folder, progress=False, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(pipe) -> torch.Tensor:
    return generate(pipe, "sd").cpu()


def reloads_to(folder, expected) -> bool:
    reloaded = diffusers.StableDiffusionPipeline.from_pretrained(folder)  # diffusers reads what we wrote
    reloaded.set_progress_bar_config(disable=True)
    return same_output(images(reloaded), expected)


def modules_of(pipe) -> dict[str, torch.nn.Module]:
    return {name: obj for name, obj in pipe.components.items() if isinstance(obj, torch.nn.Module)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_placed_diffusers_pipeline_saves_in_every_kind_and_after_reset(virtual, saved, tmp_path, kind):
    folder, original, expected = saved
    plan = kind_plan(Pipeline.plan_placement(folder, max_memory=BUDGETS), modules_of(original), kind, PARTS)
    pipe = load(folder, device_map=plan)
    placed = hooks_and_placeholders(modules_of(pipe))
    with measure_transfers() as meter:
        pipe.save_pretrained(tmp_path / "placed")
    assert meter.host_to_accelerator_bytes == 0
    assert hooks_and_placeholders(modules_of(pipe)) == placed
    assert_same_output(images(pipe), expected)
    assert reloads_to(tmp_path / "placed", expected)

    pipe.reset_device_map()
    assert not has_hooks(pipe) and pipe.hf_device_map is None
    assert not any(hasattr(module, "hf_device_map") for module in modules_of(pipe).values())  # as they were built
    pipe.save_pretrained(tmp_path / "reset")  # transformers' save read hf_device_map=None as a map: it crashed
    assert reloads_to(tmp_path / "reset", expected)
    pipe.to("cpu")  # diffusers' own guards are satisfied again


def test_a_failure_mid_save_leaves_the_target_as_it_was_and_a_save_keeps_the_users_files(
        virtual, saved, tmp_path, monkeypatch):
    folder, original, expected = saved
    target = tmp_path / "target"
    original.save_pretrained(target)
    (target / "README.md").write_text("mine")
    (target / "unet" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"another variant")
    before = tree(target)
    pipe = load(folder, device_map=kind_plan(Pipeline.plan_placement(folder, max_memory=BUDGETS),
                                             modules_of(original), "disk", PARTS))
    with monkeypatch.context() as patched:
        def fails(*args, **kwargs):
            raise RuntimeError("the disk went away")

        patched.setattr(pipe.vae, "save_pretrained", fails)  # text_encoder and unet are written by then
        with pytest.raises(RuntimeError, match="the disk went away"):
            pipe.save_pretrained(target)
    assert tree(target) == before  # diffusers alone would have left a half-written folder
    assert sorted(path.name for path in tmp_path.iterdir()) == ["target"]  # no staging folder behind

    pipe.save_pretrained(target)
    after = tree(target)
    assert after["README.md"] == b"mine"
    assert after["unet/diffusion_pytorch_model.fp16.safetensors"] == b"another variant"
    assert reloads_to(target, expected)


def tree(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_reset_gives_passed_in_components_back_and_a_second_load_pins_them_again(virtual, saved, tmp_path):
    folder, _, expected = saved
    plain = diffusers.UNet2DConditionModel.from_pretrained(folder / "unet")  # on the CPU, not device-mapped
    owned = transformers.CLIPTextModel.from_pretrained(folder / "text_encoder").to(torch_device(1))
    owned.hf_device_map = {"": 1}  # as transformers' from_pretrained(device_map={"": 1}) leaves it: no hooks
    hooked = diffusers.AutoencoderKL.from_pretrained(folder / "vae").to(torch_device(1))
    hooked.encoder.to("cpu")
    dispatch(hooked, {"": 1, "encoder": "cpu"})  # its owner's hooks, its encoder served from CPU RAM
    hooked_state = hooks_and_placeholders({"vae": hooked})
    passed = dict(unet=plain, text_encoder=owned, vae=hooked)

    pipe = load(folder, device_map="balanced", max_memory=BUDGETS, **passed)
    assert pipe.hf_device_map["text_encoder"] == 1
    assert_same_output(images(pipe), expected)
    pipe.save_pretrained(tmp_path / "placed")
    assert reloads_to(tmp_path / "placed", expected)

    pipe.reset_device_map()
    assert not hasattr(plain, "hf_device_map")
    assert set(has_hooks(pipe)) == {f"vae.{path}" for path in hooked_paths(hooked)}  # only its owner's remain
    assert {t.device for t in plain.state_dict().values()} == {torch.device("cpu")}
    assert owned.hf_device_map == {"": 1}
    assert {t.device for t in owned.state_dict().values()} == {torch_device(1)}
    assert hooks_and_placeholders({"vae": hooked}) == hooked_state  # its owner's placement, untouched
    pipe.save_pretrained(tmp_path / "reset")
    assert reloads_to(tmp_path / "reset", expected)

    again = load(folder, device_map="balanced", max_memory=BUDGETS, **passed)
    pinned = {name for name, component in again.placement_plan.components.items() if component.pinned}
    assert pinned == {"text_encoder", "vae"}
    assert_same_output(images(again), expected)


def hooked_paths(module) -> set[str]:
    return {path for path, submodule in module.named_modules() if hasattr(submodule, "_hf_hook")}

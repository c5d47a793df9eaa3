"""Placed pipelines under strict virtual accelerators: every tensor on its virtual GPU, so what would fail on
two real GPUs fails here. Each test is a device mix-up strict mode caught in the library, fixed there:
- a component passed in already placed by its owner, without hooks, got no input-moving hook;
- SDXL (and its img2img/inpaint variants) joins its two text encoders' outputs where each came back;
- an offloaded component left its outputs on its own GPU while whole ones return theirs to the caller;
- a split whose entry is a ModuleList the parent loops over hooked the list, which is never called;
- buffers no checkpoint holds (CLIP's position_ids) stayed on the CPU.
And the proof that strict mode is what catches them: a pipeline with one input hook removed fails strict and
runs not strict. Outputs are compared with diffusers' own (or the plain CPU run), as tests/same_output.py says."""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import remove_hook_from_module
from torch import nn

import pipelines
from hooks.hook_utils import hooks_of
from hooks.input_moving import MoveInputsHook
from hooks.techniques import apply_component_plan
from pipelines import Pipeline
from placement.devices import torch_device
from placement.plan_schema import ComponentPlan, PlacementKind

from pipeline_fixtures import generate as generate_ours, save_preset
from test_diffusers_pipelines import build_sd, build_sdxl, generate
from same_output import assert_same_output

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
MIXED = "Expected all tensors to be on the same device"


@pytest.fixture(autouse=True)
def two_virtual_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    for name, build in (("sd", build_sd), ("sdxl", build_sdxl)):
        torch.manual_seed(0)
        build(root / f"{name}-parts").save_pretrained(root / name)
    return {"sd": root / "sd", "sdxl": root / "sdxl"}


def reference(folder, family):
    pipe = Pipeline.from_pretrained(folder, progress=False)  # diffusers' class, on the CPU, no placement
    return generate(pipe, family)


@pytest.mark.parametrize("strict", ["1", "0"])
def test_a_missing_input_hook_fails_strict_and_runs_not_strict(folders, strict, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", strict)
    pipe = Pipeline.from_pretrained(folders["sd"], device_map={"text_encoder": 1, "unet": 0, "vae": 0},
                                    progress=False)
    remove_hook_from_module(pipe.text_encoder)  # diffusers sends it input ids on the execution device, GPU 0
    if strict == "1":
        with pytest.raises(RuntimeError, match=f"{MIXED}, but found at least two devices, vgpu:1 and vgpu:0!"):
            generate(pipe, "sd")
    else:  # every virtual GPU is the CPU: the same mix-up goes unseen
        assert_same_output(generate(pipe, "sd"), reference(folders["sd"], "sd"))


def test_a_component_placed_by_its_owner_without_hooks_gets_its_inputs_moved(folders):
    # transformers places a one-device map (device_map={"": 1}) with no hook at all
    encoder = transformers.CLIPTextModel.from_pretrained(folders["sd"] / "text_encoder").to(torch_device(1))
    encoder.hf_device_map = {"": 1}
    pipe = Pipeline.from_pretrained(folders["sd"], device_map={"unet": 0, "vae": 0}, text_encoder=encoder,
                                    progress=False)
    assert pipe.text_encoder is encoder and encoder.hf_device_map == {"": 1}  # pinned: its owner's map kept
    assert [type(hook) for hook in hooks_of(encoder)] == [MoveInputsHook]
    assert_same_output(generate(pipe, "sd").cpu(), reference(folders["sd"], "sd"))


def test_buffers_no_checkpoint_holds_follow_their_component(folders):
    pipe = Pipeline.from_pretrained(folders["sd"], device_map={"text_encoder": 1, "unet": 0, "vae": 0},
                                    progress=False)
    buffers = dict(pipe.text_encoder.named_buffers())
    assert buffers["embeddings.position_ids"].device == torch_device(1)  # persistent=False: not in the checkpoint
    assert {t.device for t in [*pipe.text_encoder.parameters(), *pipe.text_encoder.buffers()]} == {torch_device(1)}


@pytest.mark.parametrize("encoders", [(1, 0), (0, 1)])
def test_sdxl_joins_its_text_encoders_outputs_on_one_gpu(folders, encoders):
    device_map = {"text_encoder": encoders[0], "text_encoder_2": encoders[1], "unet": 0, "vae": 1}
    pipe = Pipeline.from_pretrained(folders["sdxl"], device_map=device_map, progress=False)
    assert_same_output(generate(pipe, "sdxl").cpu(), reference(folders["sdxl"], "sdxl"))


def variant_inputs():
    torch.manual_seed(3)
    image, mask = torch.rand(1, 3, 16, 16), (torch.rand(1, 1, 16, 16) > 0.5).float()
    return {
        "img2img": {"image": image, "strength": 0.6},
        "inpaint": {"image": image, "mask_image": mask, "height": 16, "width": 16, "strength": 0.9},
    }


VARIANTS = {
    ("sd", "img2img"): "StableDiffusionImg2ImgPipeline", ("sd", "inpaint"): "StableDiffusionInpaintPipeline",
    ("sdxl", "img2img"): "StableDiffusionXLImg2ImgPipeline", ("sdxl", "inpaint"): "StableDiffusionXLInpaintPipeline",
}


@pytest.mark.parametrize("family, variant", list(VARIANTS))
def test_img2img_and_inpaint_image_latents_meet_the_noise_on_one_gpu(folders, family, variant):
    cls = getattr(diffusers, VARIANTS[family, variant])
    arguments = {**variant_inputs()[variant], "prompt": "a cat", "num_inference_steps": 2, "output_type": "pt"}

    def run(pipe):
        with torch.no_grad():
            return pipe(generator=torch.Generator().manual_seed(0), **arguments).images.cpu()

    expected = run(cls.from_pretrained(folders[family]))
    placed = cls.from_pretrained(folders[family])
    modules = sorted(name for name, obj in placed.components.items() if isinstance(obj, nn.Module))
    pipelines.place(placed, device_map={name: index % 2 for index, name in enumerate(modules)})  # alternating
    assert_same_output(run(placed), expected)


def test_an_offloaded_component_returns_its_outputs_where_the_inputs_were():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = module(x)
        apply_component_plan(module, ComponentPlan(
            name="encoder", kind=PlacementKind.OFFLOADED, devices=["cpu"], execution_device=0, bytes=1,
            device_map={"": "cpu"}, placed_bytes={"cpu": 1}))
        from_gpu_1 = module(x.to(torch_device(1)))
        from_cpu = module(x)
    assert from_gpu_1.device == torch_device(1)  # ran on GPU 0
    assert_same_output(from_gpu_1, expected)
    assert from_cpu.device.type == "cpu"
    assert_same_output(from_cpu, expected)


def test_a_split_entry_that_is_a_module_list_hooks_each_block(tmp_path):
    folder, plain = save_preset(tmp_path / "tiny-flux")
    expected = generate_ours(plain)
    transformer_map = {"pos_embed": 0, "time_text_embed": 0, "context_embedder": 0, "x_embedder": 0,
                       "transformer_blocks": 0, "single_transformer_blocks": 1, "norm_out": 1, "proj_out": 1}
    pipe = Pipeline.from_pretrained(folder, device_map={"transformer": transformer_map}, progress=False,
                                    max_memory={0: "1GiB", 1: "1GiB"})
    assert pipe.hf_device_map["transformer.single_transformer_blocks"] == 1
    for block in pipe.transformer.single_transformer_blocks:  # the parent loops over the list: inputs arrive here
        assert [hook.execution_device for hook in hooks_of(block)] == [torch_device(1)]
    assert_same_output(generate_ours(pipe), expected)

"""One straight load (issue 40): a load calls `placement.plan` exactly once, at most 5 calls below
`from_pretrained`, whatever the budget (a decode that only fits tiled, a quantized component whose format cannot
be offloaded, a plain balanced load); `plan_placement(...)` is the load's plan by construction; the accelerators
are detected once per load."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import pipelines
import placement
import placement.devices
from placement.memory_model import ACCELERATOR_RUNTIME_OVERHEAD as OVERHEAD
from placement.plan_schema import MemoryTechnique

from tiny_parts import clip_config, clip_tokenizer, sd_unet, seeded

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
CALL = {"height": 64, "width": 64}
ENTRIES = ("from_pretrained", "plan_placement")
PIPELINES = Path(pipelines.__file__).parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Stable Diffusion folder whose VAE decode (64x64, 32 channels) is the largest activation."""
    root = tmp_path_factory.mktemp("one-plan")
    vae = seeded(lambda: diffusers.AutoencoderKL(sample_size=16, block_out_channels=(32,), layers_per_block=1,
                                                 latent_channels=4, norm_num_groups=1))
    diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=seeded(lambda: transformers.CLIPTextModel(clip_config())),
        tokenizer=clip_tokenizer(root / "vocab"), unet=seeded(sd_unet),
        scheduler=diffusers.EulerDiscreteScheduler(steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False).save_pretrained(root / "sd")
    return root / "sd"


class Counted:
    """Each `placement.plan` call with its depth below the entry point (the frames from the entry's to the
    planner's), and each accelerator detection."""

    def __init__(self):
        self.depths: list[int] = []
        self.detections = 0

    def reset(self) -> None:
        self.depths, self.detections = [], 0


@pytest.fixture
def counted(monkeypatch):
    found, plan, probe = Counted(), placement.plan, placement.devices.virtual_accelerator_count

    def counting_plan(*args, **kwargs):
        stack = inspect.stack(0)  # [0]: this wrapper, standing where placement.plan's own frame would be
        found.depths.append(next((depth for depth, frame in enumerate(stack) if frame.function in ENTRIES
                                  and Path(frame.filename).is_relative_to(PIPELINES)), -1))
        return plan(*args, **kwargs)

    def counting_probe():  # every detection starts here (`detect_accelerators`)
        found.detections += 1
        return probe()

    monkeypatch.setattr(placement, "plan", counting_plan)
    monkeypatch.setattr(placement.devices, "virtual_accelerator_count", counting_probe)
    return found


def load_and_plan(counted: Counted, folder, **options):
    """The load and plan_placement with the same options, each checked to call the planner once at most 5 calls
    deep and to detect the accelerators once, and plan_placement to give the load's plan."""
    counted.reset()
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map="balanced", progress=False, **options)
    assert len(counted.depths) == 1 and 0 < counted.depths[0] <= 5, counted.depths
    assert counted.detections == 1
    counted.reset()
    plan = pipelines.Pipeline.plan_placement(folder, device_map="balanced", **options)
    assert len(counted.depths) == 1 and 0 < counted.depths[0] <= 5, counted.depths
    assert counted.detections == 1
    assert plan == pipe.placement_plan
    return pipe, plan


def test_a_plain_balanced_load_plans_once(folder, counted, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    pipe, plan = load_and_plan(counted, folder, max_memory={0: "1GiB", 1: "1GiB", "cpu": "1GiB"})
    assert set(pipe.hf_device_map) == {"text_encoder", "unet", "vae"}


def test_a_decode_that_only_fits_tiled_is_planned_in_the_one_call(folder, counted, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    roomy = pipelines.Pipeline.plan_placement(folder, max_memory={0: "8GiB", 1: "8GiB", "cpu": "8GiB"},
                                              call=CALL).components
    weights = sum(component.bytes for component in roomy.values())
    room = (roomy["unet"].activation_bytes + roomy["vae"].activation_bytes) // 2  # the decode fits only tiled
    budget = {0: f"{OVERHEAD + weights + room}B", 1: 0, "cpu": "4GiB"}
    pipe, plan = load_and_plan(counted, folder, max_memory=budget, call=CALL)
    assert [used.technique for used in plan.components["vae"].memory_techniques] == [MemoryTechnique.VAE_TILING]
    assert plan.components["vae"].execution_device == 0 and pipe.vae.use_tiling


def test_a_quantized_component_that_cannot_be_offloaded_is_planned_in_the_one_call(tmp_path, counted, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from owner_folders import save_qwen_image

    import torch

    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_STRICT", "0")  # bitsandbytes' weights cannot nest in strict tensors
    folder = save_qwen_image(tmp_path)
    quantization = diffusers.PipelineQuantizationConfig(quant_mapping={"text_encoder": transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)})
    options = dict(quantization_config=quantization, torch_dtype=torch.bfloat16)
    sizes = {name: c.bytes for name, c in pipelines.Pipeline.plan_placement(
        folder, max_memory={0: "1GiB"}, **options).components.items()}
    budget = {0: f"{sizes['vae'] + sizes['text_encoder'] + 4096}B", "cpu": "1GiB"}  # not all three whole
    _, plan = load_and_plan(counted, folder, max_memory=budget, **options)
    assert plan.components["text_encoder"].kind.value == "whole"
    assert any(c.kind.value == "offloaded" for c in plan.components.values())

"""Call capture against the hand-kept family table it replaces: for every class of the table with published configs
(benchmarks/data), a folder of its real widths at depth 1, planned for a call through capture (the pipeline's own
__call__ on stand-ins), gives the tensors and runs per call the table described. Where the table did not say what
diffusers really runs, capture follows diffusers (each case below with its reason) and the comparison is made at
the call the table could describe.

What the table got wrong, found here:
- SD 1.x/2.x and their img2img, inpaint and ControlNet variants run the UNet one time more than `num_inference_steps`
  with their published PNDM scheduler (its PLMS timesteps repeat the second-to-last one): 51 runs at 50 steps.
- PixArt-Sigma and Sana bin height and width to their training resolutions (`use_resolution_binning=True` by
  default): a 128x128 call runs the transformer at 1024x1024 and resizes the result; the table planned 128x128.
- HiDream-I1 rescales any requested size to its maximum area (1024x1024 for a square).
- FLUX.1 Kontext resizes the conditioning image to a preferred resolution and bounds the output by `max_area`
  (`_auto_resize=True`, `max_area=1024**2` by default).
And what the table could not take: FLUX ControlNet-Union's `control_mode`, required by that ControlNet."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pipelines import Pipeline
from pipelines.hf.calls import FAMILIES, family_calls, family_runs
import pipelines.loading.planning as planning
from recorded_calls import _shapes

_BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
_spec = importlib.util.spec_from_file_location("real_folders", _BENCHMARKS / "real_folders.py")
real_folders = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_folders)

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")

BASES = {"StableDiffusion": "sd15", "StableDiffusionXL": "sdxl-base-1.0", "StableDiffusion3": "sd3-medium",
         "Flux": "flux1-dev", "PixArtSigma": "pixart-sigma-1024", "Sana": "sana-1600m-1024", "QwenImage": "qwen-image",
         "HiDreamImage": "hidream-i1-full", "CogVideoX": "cogvideox-5b", "HunyuanVideo": "hunyuanvideo",
         "Wan": "wan2.1-t2v-1.3b", "WanImageToVideo": "wan2.1-i2v-14b-480p", "LTX": "ltx-video-0.9"}
VARIANTS = ("Pipeline", "Img2Img", "Inpaint", "ControlNet", "Fill", "Kontext")
WATCHED = ("unet", "transformer", "controlnet", "vae")
PNDM = {"StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline",
        "StableDiffusionControlNetPipeline", "StableDiffusionControlNetImg2ImgPipeline",
        "StableDiffusionControlNetInpaintPipeline"}
# What the table's call could not say, given to capture so the two describe the same call (module doc).
CAPTURE_ONLY = {"PixArtSigmaPipeline": {"use_resolution_binning": False},
                "SanaPipeline": {"use_resolution_binning": False},
                "FluxKontextPipeline": {"_auto_resize": False, "max_area": 128 * 128},
                "FluxControlNetPipeline": {"control_mode": 0}}
SIDE = {"HiDreamImagePipeline": 1024}  # sizes it does not rescale


def base_of(class_name: str) -> str | None:
    for prefix in sorted(BASES, key=len, reverse=True):
        if class_name.startswith(prefix) and class_name[len(prefix):].startswith(VARIANTS):
            return BASES[prefix]
    return None


CLASSES = [name for name in FAMILIES if base_of(name) is not None]


def variant_folder(root: Path, class_name: str) -> Path:
    """The base family's folder written as `class_name`'s: its ControlNet added, FLUX Fill's wider input."""
    key = base_of(class_name)
    folder = real_folders.write_folder(root / class_name, key, depth=1)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = class_name
    if "ControlNet" in class_name:
        spec = real_folders.PIPELINES[key]["components"]["controlnet"]
        (folder / "controlnet").mkdir(exist_ok=True)
        config = {"_class_name": spec["class"], **real_folders.shallow(spec["config"])}
        (folder / "controlnet" / "config.json").write_text(json.dumps(config))
        index["controlnet"] = [spec["library"], spec["class"]]
    if class_name == "FluxFillPipeline":  # its transformer takes the masked image's latents beside the noise
        config = json.loads((folder / "transformer" / "config.json").read_text())
        (folder / "transformer" / "config.json").write_text(json.dumps({**config, "in_channels": 384,
                                                                         "out_channels": 64}))
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def described(calls) -> dict:
    found = {}
    for name in WATCHED:
        for example in calls.get(name, ()):
            found.setdefault((name, example.method), _shapes(example.args, dict(example.kwargs)))
    return found


@pytest.mark.parametrize("class_name", CLASSES)
def test_capture_gives_the_tables_shapes_and_runs(tmp_path, monkeypatch, class_name):
    folder = variant_folder(tmp_path, class_name)
    family = FAMILIES[class_name]
    side = SIDE.get(class_name, 128)
    call = {"height": 64, "width": 64, "num_frames": 9} if family.video else {"height": side, "width": side}
    call["num_inference_steps"] = 4
    seen = {}
    original = planning.capture_call

    def spy(pipe, modules, call, **kwargs):
        seen["modules"], seen["captured"] = modules, original(pipe, modules, call, **kwargs)
        return seen["captured"]

    monkeypatch.setattr(planning, "capture_call", spy)
    plan = Pipeline.plan_placement(folder, max_memory={0: "80GiB", "cpu": "64GiB"},
                                   call={**call, **CAPTURE_ONLY.get(class_name, {})})
    table_runs = {name: runs + (class_name in PNDM)
                  for name, runs in family_runs(class_name, call).items() if name in plan.components}
    assert {name: plan.inputs.runs_per_call[name] for name in table_runs} == table_runs
    assert described(seen["captured"].calls) == described(family_calls(class_name, seen["modules"], call))

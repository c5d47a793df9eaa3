"""Planning with `call=` at the sizes users call, on tiny weights (only shapes matter to a plan): SkyReels V2 at
544x960x97 (issue 41), Allegro at its published 720x1280x88, whose VAE decodes only in tiles; and what a plan says
when a denoiser's own code cannot run the call at all."""

from __future__ import annotations

import json

import pytest
import torch

import tiny_videos
from pipelines import Pipeline
from pipelines.errors import CallSpecError
from placement.errors import DoesNotFitError
from placement.plan_schema import MemoryTechnique
from same_output import assert_same_output

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
ROOMY = {0: "24GiB", 1: "24GiB", "cpu": "64GiB"}
SKYREELS_540P = {"prompt": "a", "height": 544, "width": 960}


@pytest.fixture(autouse=True)
def two_virtual_gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


def saved(build, folder, **options):
    torch.manual_seed(0)
    build(folder.parent / f"{folder.name}-parts", **options).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def skyreels(tmp_path_factory):
    return saved(tiny_videos.skyreels_v2, tmp_path_factory.mktemp("skyreels") / "pipe")


@pytest.mark.parametrize("frames", [97, 121])
def test_skyreels_v2_plans_its_540p_call_with_every_activation_counted(skyreels, frames):
    """Its scalar timestep is right (SkyReelsV2Pipeline is not the diffusion-forcing class); what failed at
    544x960 was the tiny config's 32-row rotary table (34 patches high), which the published config (1024) has not."""
    plan = Pipeline.plan_placement(skyreels, max_memory=ROOMY, call={**SKYREELS_540P, "num_frames": frames})
    assert not any(component.activations_not_counted for component in plan.components.values())
    assert all(plan.components[name].activation_bytes > 0 for name in ("text_encoder", "transformer", "vae"))
    assert plan.inputs.runs_per_call["transformer"] == 100  # 50 steps, two passes each (guidance)


def test_skyreels_v2_diffusion_forcing_plans_its_per_frame_timesteps_at_540p(tmp_path):
    folder = saved(tiny_videos.skyreels_v2_df, tmp_path / "pipe")
    plan = Pipeline.plan_placement(folder, max_memory=ROOMY, call={**SKYREELS_540P, "num_frames": 97})
    assert not any(component.activations_not_counted for component in plan.components.values())
    assert plan.components["transformer"].activation_bytes > 0


def test_more_frames_more_activations(skyreels):
    peaks = [Pipeline.plan_placement(skyreels, max_memory=ROOMY, call={**SKYREELS_540P, "num_frames": frames,
                                                                        "num_inference_steps": 1})
             .components["transformer"].activation_bytes for frames in (33, 97)]
    assert peaks[0] < peaks[1]


def test_a_denoiser_whose_own_code_refuses_the_call_is_planned_on_its_weights_and_says_why(tmp_path):
    """A rotary table of 32 rows cannot hold 34 patches: the model's own `view` fails, in diffusers' run as on fake
    tensors. The plan is still made: its output taken as its latents' shape, its activations not counted, said."""
    folder = saved(tiny_videos.skyreels_v2, tmp_path / "pipe")
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_max_seq_len": 32}))
    transformer = diffusers.SkyReelsV2Transformer3DModel.from_pretrained(folder / "transformer")
    with pytest.raises(RuntimeError, match=r"shape '\[1, 34, 1, -1\]' is invalid"):  # diffusers' own code
        transformer.rope(torch.empty(1, 16, 25, 68, 120, device="meta"))
    with pytest.warns(UserWarning, match="counts transformer's weights only") as warned:
        plan = Pipeline.plan_placement(folder, max_memory=ROOMY, call={**SKYREELS_540P, "num_frames": 97})
    why = plan.components["transformer"].activations_not_counted
    assert "shape '[1, 34, 1, -1]' is invalid" in why and "a real run of this call may raise too" in why
    assert "its latents' shape (hidden_states float32[1, 16, 25, 68, 120] -> float32[1, 16, 25, 68, 120]" in why
    assert any("not in the predicted time" in str(warning.message) for warning in warned)
    assert plan.components["transformer"].activation_bytes == 0
    assert plan.components["vae"].activation_bytes > 0 and not plan.components["vae"].activations_not_counted


@pytest.fixture(scope="module")
def allegro(tmp_path_factory):
    root = tmp_path_factory.mktemp("allegro")
    return {"published": saved(tiny_videos.allegro, root / "published", tile=320),
            "tiny": saved(tiny_videos.allegro, root / "tiny", tile=128)}


REQUIRED = "required: AutoencoderKLAllegro.decode without vae_tiling raises NotImplementedError: Decoding without " \
           "tiling has not been implemented yet"


def test_allegro_plans_its_published_call_tiled_because_its_vae_decodes_only_in_tiles(allegro):
    plan = Pipeline.plan_placement(allegro["published"], max_memory=ROOMY,
                                   call={"prompt": "a", "height": 720, "width": 1280, "num_frames": 88})
    (used,) = plan.components["vae"].memory_techniques
    assert used.technique is MemoryTechnique.VAE_TILING and used.reason.startswith(REQUIRED)
    assert plan.components["vae"].activation_bytes > 0 and plan.activations_accounted
    # without call= too: the load turns tiling on, as diffusers' users do by hand
    (used,) = Pipeline.plan_placement(allegro["published"], max_memory=ROOMY).components["vae"].memory_techniques
    assert used.technique is MemoryTechnique.VAE_TILING and used.reason.startswith(REQUIRED)


TINY_CALL = {"prompt": "a cat", "negative_prompt": "", "height": 128, "width": 128, "num_frames": 24,
             "max_sequence_length": 8, "num_inference_steps": 2}


def test_allegro_refusals_say_it_cannot_decode_whole(allegro):
    with pytest.raises(CallSpecError, match=r"forbids vae_tiling .* vae cannot run this call without it "
                                            r"\(AutoencoderKLAllegro.decode without vae_tiling raises"):
        Pipeline.plan_placement(allegro["tiny"], max_memory=ROOMY, call={**TINY_CALL, "vae_tiling": False})
    with pytest.raises(DoesNotFitError, match=r"with vae_tiling, which it cannot run without \(AutoencoderKLAllegro"):
        Pipeline.plan_placement(allegro["tiny"], max_memory={0: "8MiB", "cpu": "8MiB"}, call=TINY_CALL)


def test_allegro_placed_on_two_gpus_runs_tiled_equal_to_diffusers(allegro):
    folder = allegro["tiny"]
    reference = diffusers.AllegroPipeline.from_pretrained(folder)
    reference.vae.enable_tiling()  # what diffusers' users (and its own tests) do
    expected = generate(reference)
    plan = Pipeline.plan_placement(folder, max_memory=ROOMY, call=TINY_CALL)
    budget = sum(component.bytes for component in plan.components.values()) * 6 // 10 + (1 << 30) + max(
        component.activation_bytes for component in plan.components.values())
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={0: budget, 1: budget, "cpu": "4GiB"},
                                    call=TINY_CALL, progress=False)
    assert {component.execution_device for component in pipe.placement_plan.components.values()} == {0, 1}
    assert pipe.vae.use_tiling  # turned on by the load, as planned
    assert_same_output(generate(pipe), expected)


def generate(pipe) -> torch.Tensor:
    with torch.no_grad():
        return pipe(**TINY_CALL, generator=torch.Generator().manual_seed(0), output_type="pt").frames.cpu()

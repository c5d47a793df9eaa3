"""The presets built from diffusers and transformers classes: `flux` (FLUX.1-dev's published configs) planned and
inspected on meta without a weight read, the other real pipelines' folders, and `tiny-flux` run placed on two strict
virtual GPUs as diffusers' own FluxPipeline runs the same folder on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import pipelines.cli.advice
from pipelines.cli import main
from pipelines.cli.args import CONFIGS_ONLY_PRESETS
from pipelines.presets import catalog, real_folders

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")

FLUX_CLASSES = {"text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel",
                "transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL"}


def test_plan_flux_plans_the_real_flux_transformer_on_meta_without_weights(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "flux", "--height", "1024", "--width", "1024", "--max-memory", "0=24GiB,cpu=64GiB",
                 "--dtype", "bf16", "--json", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Preset flux: diffusers' FluxPipeline (text_encoder CLIPTextModel, text_encoder_2 "
                          "T5EncoderModel, transformer FluxTransformer2DModel, vae AutoencoderKL); flux1-dev's "
                          "published configs, built on meta (no weights).")
    assert "Planned for the call: height=1024, width=1024" in out
    folder = catalog.preset_folder("flux")  # the folder planned: configs, tokenizers, scheduler; no weights to read
    assert not [path for path in folder.rglob("*") if path.suffix in (".safetensors", ".bin", ".pt", ".gguf")]
    assert set(FLUX_CLASSES) <= set(json.loads(plan_file.read_text())["components"])
    # FLUX.1-dev's transformer: 11.9 B parameters, 22.17 GiB in bf16 (its published size, real_pipelines.json)
    assert "transformer needs 22.17 GiB (bfloat16)" in out


def test_inspect_flux_names_each_components_class(capsys):
    assert main(["inspect", "flux", "--max-memory", "0=24GiB,cpu=64GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("flux: 4 module components, and tokenizer (CLIPTokenizer), tokenizer_2 (T5Tokenizer")
    rows = {line.split()[0]: line.split()[1] for line in lines[2:6]}
    assert rows == FLUX_CLASSES


@pytest.mark.parametrize("preset", sorted(catalog.REAL_PRESETS))
def test_each_real_preset_is_its_published_pipeline_written_once_into_the_cache(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # never written into the working directory
    folder = catalog.preset_folder(preset)
    family = real_folders.PIPELINES[catalog.REAL_PRESETS[preset]]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == family["pipeline_class"]
    for name, spec in family["components"].items():
        if not spec.get("optional"):
            assert index[name] == [spec["library"], spec["class"]]
            assert json.loads((folder / name / "config.json").read_text())["_class_name"] == spec["class"]
    assert folder.parent == catalog.presets_home() and list(tmp_path.iterdir()) == []
    written = (folder / "model_index.json").stat().st_mtime_ns
    assert catalog.preset_folder(preset) == folder and (folder / "model_index.json").stat().st_mtime_ns == written
    assert CONFIGS_ONLY_PRESETS[preset] == family["hf_repo"]  # the Hub id `placement run` names instead


def test_the_cli_knows_exactly_the_real_presets_as_configs_only():
    assert set(CONFIGS_ONLY_PRESETS) == set(catalog.REAL_PRESETS)


def test_running_a_configs_only_preset_is_refused_with_what_to_run(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a lighthouse\n")
    assert main(["run", "flux", "--prompts", str(prompts), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "The flux preset has the published configs only, no weights" in err
    assert "black-forest-labs/FLUX.1-dev" in err and "tiny-flux" in err and not (tmp_path / "out").exists()


CALL = {"height": 32, "width": 32, "num_inference_steps": 2}
SPLIT = {"text_encoder": 0, "text_encoder_2": 1, "transformer": 0, "vae": 1}  # every edge crosses a GPU


def test_tiny_flux_placed_on_two_virtual_gpus_makes_diffusers_own_cpu_image(tmp_path, capsys, monkeypatch):
    import diffusers
    import torch

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a lighthouse at dusk\n")
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    plans = []
    planner = pipelines.cli.advice.plan_with_advice
    monkeypatch.setattr(pipelines.cli.advice, "plan_with_advice",
                        lambda *args, **kwargs: plans.append(planner(*args, **kwargs)) or plans[-1])
    assert main(["run", "tiny-flux", "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--height", "32",
                 "--width", "32", "--steps", "2", "--strategy", json.dumps(SPLIT)]) == 0
    assert "1 image(s) made" in capsys.readouterr().out
    ((plan, _),) = plans
    assert plan.device_map == SPLIT
    placed = np.asarray(Image.open(tmp_path / "out" / "00000.png").convert("RGB"), dtype=np.int16)

    pipe = diffusers.FluxPipeline.from_pretrained(catalog.preset_folder("tiny-flux"))
    pipe.set_progress_bar_config(disable=True)
    reference = pipe("a lighthouse at dusk", generator=torch.Generator("cpu").manual_seed(0), **CALL).images[0]
    expected = np.asarray(reference.convert("RGB"), dtype=np.int16)
    # Placed and plain float32 runs agree to a few ulps (tests/same_output.py); an ulp can move a pixel across
    # a rounding boundary of the 8-bit image, hence one level of tolerance.
    assert placed.shape == expected.shape == (32, 32, 3)
    assert np.abs(placed - expected).max() <= 1
    assert placed.std() > 0  # an image, not a blank


def test_tiny_sd15_the_unet_example_placed_on_two_virtual_gpus_makes_diffusers_own_cpu_image(monkeypatch):
    """The runnable UNet preset: StableDiffusionPipeline's classes at diffusers' own test sizes, its UNet split
    between two strict virtual GPUs (its up blocks on the other GPU), against diffusers' own CPU run."""
    import diffusers
    import torch

    import pipelines

    folder = catalog.preset_folder("tiny-sd15")
    assert json.loads((folder / "model_index.json").read_text())["unet"] == ["diffusers", "UNet2DConditionModel"]
    call = {"height": 64, "width": 64, "num_inference_steps": 2, "output_type": "np"}
    reference_pipe = diffusers.StableDiffusionPipeline.from_pretrained(folder)
    reference_pipe.set_progress_bar_config(disable=True)
    expected = reference_pipe("a lighthouse", generator=torch.Generator("cpu").manual_seed(0), **call).images
    split = {"text_encoder": 0, "unet": {"conv_in": 0, "time_proj": 0, "time_embedding": 0, "down_blocks": 0,
                                         "mid_block": 0, "up_blocks": 1, "conv_norm_out": 1, "conv_act": 1,
                                         "conv_out": 1}, "vae": 1}
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map=split, progress=False)
    assert type(pipe) is diffusers.StableDiffusionPipeline
    assert pipe.hf_device_map["unet.up_blocks"] == 1 and pipe.hf_device_map["unet.down_blocks"] == 0
    pipe.set_progress_bar_config(disable=True)
    placed = pipe("a lighthouse", generator=torch.Generator("cpu").manual_seed(0), **call).images
    # float32 on both sides, the same kernels on the CPU: equal to float32 rounding (tests/same_output.py)
    assert placed.shape == expected.shape == (1, 64, 64, 3)
    np.testing.assert_allclose(placed, expected, atol=1e-5)


def test_tiny_flux_weights_are_seeded_and_leave_the_callers_rng_alone():
    import torch

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    one = catalog._seeded_module(*catalog.TINY_FLUX["transformer"])
    assert torch.equal(torch.random.get_rng_state(), before)
    two = catalog._seeded_module(*catalog.TINY_FLUX["transformer"])
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values()))


def test_a_twin_process_that_wrote_the_folder_first_is_read_and_no_draft_is_left(monkeypatch):
    """Replicas started together write the same preset at once: one rename wins, the others read its folder."""
    import shutil

    folder = catalog.preset_folder("sd15")
    shutil.rmtree(folder)
    write = catalog._write

    def write_beside_a_twin(draft, *args):
        write(draft, *args)
        write(folder, *args)  # the twin renamed its copy into place meanwhile

    monkeypatch.setattr(catalog, "_write", write_beside_a_twin)
    assert catalog.preset_folder("sd15") == folder and (folder / "model_index.json").is_file()
    assert [path.name for path in catalog.presets_home().iterdir() if path.name.startswith(".")] == []


def test_an_unknown_preset_names_the_presets():
    from pipelines.errors import LoadError

    with pytest.raises(LoadError, match="Unknown preset 'flux2'; the presets built from diffusers classes are "
                                        "tiny-flux, tiny-sd15, flux, sd15"):
        catalog.preset_folder("flux2")

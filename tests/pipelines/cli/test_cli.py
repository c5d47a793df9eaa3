"""The `placement` console script: `demo` and `plan`."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
from PIL import Image

from pipelines.cli import main
from pipelines.cli.args import budgets_arg
from pipelines.cli.targets import resolve_budgets_arg
from placement import Plan
from placement.sizes import GiB, parse_size

from pipelines.presets.catalog import preset_folder

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


def test_demo_writes_the_image_and_prints_both_plans(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--size", "16", "--steps", "1", "--simulate", "2x24GiB"]) == 0
    out = capsys.readouterr().out
    with Image.open(tmp_path / "demo.png") as image:
        assert image.size == (16, 16)
    assert "pipe.hf_device_map = {'text_encoder': " in out
    assert out.count("Placement plan") == 2
    assert "GPU 0: 24 GiB, GPU 1: 24 GiB" in out and "wrote demo.png" in out
    assert "weights are random, so the image is noise" in out
    assert "That plan's picture: plan.svg" in out and (tmp_path / "plan.svg").read_text().startswith("<svg")
    from placement.devices import accelerators_present

    if accelerators_present() < 2:  # the two 24 GiB GPUs are simulated here; balanced keeps the tiny pipeline on one
        assert "Simulated: planned for " in out and "GPU 1 is left empty: this map keeps every component on GPU 0" in out
        assert "Simulated: planned for" in (tmp_path / "plan.svg").read_text()


def test_plan_of_a_preset_prints_the_table_and_writes_json(tmp_path, capsys):
    target = tmp_path / "out" / "plan.json"
    code = main(["plan", "flux", "--max-memory", "0=24GiB,1=24GiB", "--dtype", "bf16", "--json", str(target)])
    assert code == 0
    out = capsys.readouterr().out
    assert "Placement plan" in out and "transformer" in out and "GPU 1" in out
    assert out.startswith("Preset flux: diffusers' FluxPipeline (text_encoder CLIPTextModel, text_encoder_2 "
                          "T5EncoderModel, transformer FluxTransformer2DModel, vae AutoencoderKL)")
    plan = Plan.from_json(target.read_text())
    assert list(plan.components) == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert {d for c in plan.components.values() for d in c.devices} == {0, 1}  # 31 GiB spread over two 24 GiB
    assert not plan.activations_accounted


def test_plan_of_a_folder_with_a_call_accounts_for_activations(tmp_path, capsys):
    folder = preset_folder("tiny-flux")
    target = tmp_path / "plan.json"
    code = main(["plan", str(folder), "--max-memory", "0=8GiB,1=8GiB", "--strategy", "sequential",
                 "--height", "64", "--width", "64", "--batch-size", "2", "--json", str(target)])
    assert code == 0
    plan = Plan.from_json(target.read_text())
    assert plan.activations_accounted and plan.strategy == "sequential"
    assert all(c.activation_bytes and c.activation_bytes > 0 for c in plan.components.values())
    assert "Activations accounted for" in capsys.readouterr().out


def test_bad_arguments_are_reported_without_a_traceback(tmp_path, monkeypatch, capsys):
    assert main(["plan", "tiny-flux", "--max-memory", "0=24Gx"]) == 2
    err = capsys.readouterr().err
    assert "--max-memory 0=24Gx: Invalid memory size '24Gx'" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as refused:  # refused while parsing the arguments: before any plan
        main(["plan", "tiny-flux", "--strategy", "fastest", "--max-memory", "0=1GiB"])
    assert refused.value.code == 2 and "unknown strategy 'fastest'" in capsys.readouterr().err

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert main(["plan", "someone/no-such-pipeline"]) == 2
    assert ("not a preset (tiny-flux, tiny-sd15, flux, sd15, sdxl, sd3-medium, "
            "sd35-large, wan2.1-t2v-14b)") in capsys.readouterr().err
    assert main(["plan", "tiny-flax2"]) == 2  # two edits from a preset: tried as a Hub id, then the closest preset
    err = capsys.readouterr().err
    assert "did you mean 'tiny-flux'?" in err and "looked for" in err and "LocalEntryNotFoundError: offline" in err
    for typo in ("tiny-flx", "tiny_flux", "Tiny-Flux", "tiny-sd1"):  # one edit: said at once, the Hub never asked
        assert main(["plan", typo]) == 2
        err = capsys.readouterr().err
        # one short line: the message, the guess and the presets' names
        assert f"{typo!r} is not a preset; did you mean" in err and "Hub did not" not in err and len(err) < 300


def budgets(text):
    """The parsed budgets in bytes (the CLI hands them on as exact byte strings, "25769803776B": never taken for a
    unit left out by the library's entries)."""
    resolved = resolve_budgets_arg(budgets_arg(text), "--max-memory")
    assert all(isinstance(size, str) and size.endswith("B") for size in resolved.values())
    return {device: parse_size(size) for device, size in resolved.items()}


def test_budget_arguments_parse_sizes_the_one_way():
    assert budgets("0=24GiB,1=10GB,cpu=64GiB") == {0: 24 * GiB, 1: 10 * 1000**3, "cpu": 64 * GiB}
    assert budgets("2x24GiB") == {0: 24 * GiB, 1: 24 * GiB}
    assert budgets("2x24GiB,cpu=64GiB") == {0: 24 * GiB, 1: 24 * GiB, "cpu": 64 * GiB}
    assert budgets("0=12GiB,2x24GiB") == {0: 12 * GiB, 1: 24 * GiB, 2: 24 * GiB}
    assert json.dumps(budgets("0=1GiB")) == json.dumps({0: GiB})


def test_help_works_and_the_console_script_is_this_main(capsys):
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "placement"]
    assert script.value == "pipelines.cli:main"
    for argv, expected in ((["--help"], ("demo", "plan", "inspect")), (["plan", "--help"], ("--max-memory", "--strategy"))):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and all(word in out for word in expected)


def test_an_old_preset_name_gets_one_line_naming_its_replacement(capsys):
    """The presets of the library's own models are retired with them: each old name names the diffusers preset
    that replaces it, before torch loads, for every command that takes a TARGET."""
    for old, new in (("tiny-dit", "tiny-flux"), ("tiny-unet", "tiny-sd15"), ("flux-like", "flux"),
                     ("sdxl-like", "sdxl")):
        for command in (["plan", old], ["inspect", old], ["run", old, "--prompts", "p.txt", "--out", "o"]):
            assert main(command) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"The {old} preset (this library's own models) is retired: use {new}," in err


def test_layerwise_casting_on_a_preset_plans_its_folder(capsys):
    """A preset is a folder of diffusers classes, so --layerwise-casting plans its load as for any folder."""
    assert main(["plan", "tiny-flux", "--layerwise-casting", "transformer=fp8", "--max-memory", "cpu=1GiB"]) == 0
    assert "layerwise float8_e4m3fn" in capsys.readouterr().out
    assert main(["plan", "flux", "--layerwise-casting", "denoiser=fp8"]) == 2  # a name the preset lacks
    assert "layerwise_casting names ['denoiser'], which are not module components of this pipeline; its module " \
           "components are ['text_encoder', 'text_encoder_2', 'transformer', 'vae']" in capsys.readouterr().err

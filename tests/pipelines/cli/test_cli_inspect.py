"""`placement inspect` and the pictures `placement plan --svg` and `placement demo` draw."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from pipelines.cli import main

from pipelines.presets.catalog import preset_folder

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


def test_inspect_a_preset_lists_components_classes_sizes_and_where_each_could_run(capsys):
    assert main(["inspect", "sdxl", "--max-memory", "0=8GiB,cpu=64GiB"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == ("sdxl: 4 module components, and tokenizer (CLIPTokenizer), tokenizer_2 (CLIPTokenizer), "
                        "scheduler (EulerDiscreteScheduler)")
    rows = {line.split()[0]: line for line in lines[1:7]}
    assert rows["unet"].split()[1] == "UNet2DConditionModel"  # each component's diffusers/transformers class
    assert "9.56 GiB (float32)" in rows["unet"] and "4.78 GiB" in rows["unet"]
    assert rows["unet"].endswith("offloaded (streamed to a GPU)")  # 9.56 GiB does not fit 8 GiB whole
    assert rows["text_encoder"].endswith("whole on GPU 0") and rows["text_encoder"].split()[1] == "CLIPTextModel"
    assert rows["text_encoder_2"].split()[1] == "CLIPTextModelWithProjection" and "AutoencoderKL" in rows["vae"]
    assert "largest block (as saved)" in lines[1] and "12.92 GiB" in rows["total"]


def test_inspect_a_folder_at_a_dtype(tmp_path, capsys):
    folder = preset_folder("tiny-flux")
    assert main(["inspect", str(folder), "--dtype", "bf16", "--max-memory", "2x1GiB"]) == 0
    out = capsys.readouterr().out
    assert "FluxTransformer2DModel" in out and "could run on (bfloat16)" in out and "whole on GPU 0, GPU 1" in out


def test_plan_svg_is_written_and_names_every_component_and_device(tmp_path, capsys):
    target = tmp_path / "pictures" / "plan.svg"
    assert main(["plan", "flux", "--max-memory", "2x24GiB", "--dtype", "bf16", "--svg", str(target)]) == 0
    assert f"Plan picture written to {target}" in capsys.readouterr().out
    texts = [t.text for t in ET.parse(target).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert {"text_encoder", "text_encoder_2", "transformer", "vae", "GPU 0", "GPU 1", "CPU"} <= set(texts)
    assert any(text.startswith("Activations NOT counted (planned without a call)") for text in texts)  # no --height

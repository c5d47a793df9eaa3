"""On a CUDA machine: a balanced load over GPU 0 whose budget forces one component to be offloaded gives the
images of a plain all-on-GPU run. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from pipelines import TextToImagePipeline

from pipeline_fixtures import generate, save_preset

pytestmark = [pytest.mark.gpu]


def test_offloaded_denoiser_on_gpu0_matches_a_plain_gpu_run(tmp_path):
    folder, pipe = save_preset(tmp_path / "tiny-dit")
    expected = generate(pipe.to("cuda"), height=64, width=64)

    full_plan = TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"})
    sizes = {name: component.bytes for name, component in full_plan.components.items()}
    others = sum(size for name, size in sizes.items() if name != "denoiser")
    budget = others + sizes["denoiser"] // 2  # everything but the denoiser fits; the denoiser alone does not
    loaded = TextToImagePipeline.from_pretrained(folder, device_map="balanced", max_memory={0: budget, "cpu": "8GiB"},
                                                 progress=False)
    kinds = {name: c.kind.value for name, c in loaded.placement_plan.components.items()}
    assert kinds["denoiser"] == "offloaded" and loaded.placement_plan.components["denoiser"].execution_device == 0
    assert all(kind == "whole" for name, kind in kinds.items() if name != "denoiser")
    assert loaded.hf_device_map["denoiser"] == "cpu" and loaded.hf_device_map["vae"] == 0
    assert next(loaded.text_encoder.parameters()).device.type == "cuda"

    torch.testing.assert_close(generate(loaded, height=64, width=64), expected, atol=1e-3, rtol=0)
    loaded.reset_device_map()
    assert {p.device.type for m in loaded.module_components.values() for p in m.parameters()} == {"cpu"}

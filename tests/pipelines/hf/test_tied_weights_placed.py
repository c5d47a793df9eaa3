"""A tied weight is one tensor in every plan: T5's `encoder.embed_tokens` shares `shared`'s embedding, and FLUX
with one usable GPU (the most common consumer case) split, streamed or loaded per call its T5 with that module in
no list (`PlanError`, `OffloadConfigError` at load). At every budget the planner accepts, the placed
pipeline now loads, runs equal to diffusers' own, takes a LoRA into its transformer wherever the plan put it
(whole, streamed, loaded per call, CPU) and gives what diffusers gives with it, keeps the tie and resets clean."""

from __future__ import annotations

import pytest
import torch

from pipelines import Pipeline
from same_output import assert_same_output
from test_diffusers_pipelines import build_flux, generate, has_hooks

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
from test_placed_adapters import make_lora  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
# Shares of the weights one GPU may hold: everything on the CPU, encoders streamed or loaded per call, the
# transformer streamed, whole components beside offloaded ones, everything whole.
SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.2)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    build_flux(root / "parts").save_pretrained(root / "flux")
    folder = root / "flux"
    weights = sum(component.bytes for component in Pipeline.plan_placement(
        folder, max_memory={0: "8GiB", "cpu": "8GiB"}).components.values())
    plain = diffusers.FluxPipeline.from_pretrained(folder)
    expected = generate(plain, "flux")
    make_lora(root / "lora", plain, seed=1)
    plain.load_lora_weights(root / "lora", adapter_name="a")
    return folder, weights, expected, generate(plain, "flux"), root / "lora"


@pytest.mark.parametrize("share", SHARES)
def test_flux_on_one_gpu_loads_and_runs_at_every_budget(flux, share, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, weights, expected, with_lora, lora = flux
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", progress=False,
                                    max_memory={0: f"{int(share * weights)}B", "cpu": "4GiB"})
    t5 = pipe.text_encoder_2
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # still one tensor
    assert_same_output(generate(pipe, "flux"), expected)
    assert_same_output(generate(pipe, "flux"), expected)  # and again: per-call loads come back
    pipe.load_lora_weights(lora, adapter_name="a")
    assert_same_output(generate(pipe, "flux"), with_lora)
    pipe.unload_lora_weights()
    assert_same_output(generate(pipe, "flux"), expected)
    pipe.reset_device_map()
    assert not has_hooks(pipe) and t5.shared.weight is t5.encoder.embed_tokens.weight

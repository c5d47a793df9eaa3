"""TextToImagePipeline: presets, classifier-free guidance, output types, text conditioning, call= planning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines import TextEncoder, TextToImagePipeline
from pipelines.errors import CallError, LoadError
from pipelines.text_to_image.pipeline import SequenceSource, text_conditioning_for

from own_fixtures import generate
from same_output import assert_same_output


@pytest.fixture(scope="module")
def tiny_dit():
    return TextToImagePipeline.from_preset("tiny-dit", seed=0)


@pytest.fixture(scope="module")
def tiny_unet():
    return TextToImagePipeline.from_preset("tiny-unet", seed=0)


@pytest.mark.parametrize("fixture", ["tiny_dit", "tiny_unet"])
def test_output_types_have_the_documented_shapes_and_agree(request, fixture):
    pipe = request.getfixturevalue(fixture)
    kwargs = dict(height=16, width=24, num_inference_steps=1, num_images_per_prompt=2)
    pt = pipe(["a", "b"], generator=torch.Generator().manual_seed(1), output_type="pt", **kwargs).images
    arr = pipe(["a", "b"], generator=torch.Generator().manual_seed(1), output_type="np", **kwargs).images
    pil = pipe(["a", "b"], generator=torch.Generator().manual_seed(1), output_type="pil", **kwargs).images
    assert pt.shape == (4, 3, 16, 24) and pt.dtype == torch.float32
    assert 0.0 <= float(pt.min()) and float(pt.max()) <= 1.0
    assert arr.shape == (4, 16, 24, 3) and isinstance(arr, np.ndarray)
    np.testing.assert_allclose(arr, pt.permute(0, 2, 3, 1).numpy(), atol=1e-6)
    assert len(pil) == 4 and all(isinstance(image, Image.Image) and image.size == (24, 16) for image in pil)
    np.testing.assert_array_equal(np.asarray(pil[0]), (arr[0] * 255).round().astype(np.uint8))


def test_seeded_calls_repeat_and_guidance_changes_the_result(tiny_dit):
    first, again = generate(tiny_dit), generate(tiny_dit)
    torch.testing.assert_close(first, again, atol=0, rtol=0)  # the same pipeline and seed twice: deterministic
    unguided = generate(tiny_dit, guidance_scale=1.0)
    strong = generate(tiny_dit, guidance_scale=9.0)
    assert not torch.allclose(first, unguided) and not torch.allclose(first, strong)


def test_guidance_runs_the_denoiser_on_a_doubled_batch(tiny_unet):
    batches = []
    handle = tiny_unet.denoiser.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
    try:
        generate(tiny_unet, guidance_scale=3.0, num_images_per_prompt=3, num_inference_steps=1)
        generate(tiny_unet, guidance_scale=1.0, num_images_per_prompt=3, num_inference_steps=1)
    finally:
        handle.remove()
    assert batches == [6, 3]


def test_bad_call_arguments_are_clear_errors(tiny_dit):
    with pytest.raises(CallError, match="output_type='jpeg'.*'pil', 'np', 'pt'"):
        generate(tiny_dit, output_type="jpeg")
    with pytest.raises(CallError, match="multiples of 4"):
        generate(tiny_dit, height=30)
    with pytest.raises(CallError, match="negative prompts"):
        tiny_dit(["a", "b"], negative_prompt=["x"], height=32, width=32, num_inference_steps=1)


def test_presets_on_meta_have_their_real_sizes_and_conditioning():
    sdxl = TextToImagePipeline.from_preset("sdxl-like", device="meta")
    flux = TextToImagePipeline.from_preset("flux-like", device="meta")
    billions = {name: sum(p.numel() for p in m.parameters()) / 1e9 for name, m in flux.module_components.items()}
    assert 11 < billions["denoiser"] < 13 and 4.2 < billions["text_encoder_2"] < 5.2
    assert 2.3 < sum(p.numel() for p in sdxl.denoiser.parameters()) / 1e9 < 2.9
    assert all(p.is_meta for m in flux.module_components.values() for p in m.parameters())
    assert sdxl.text_conditioning.sequence is SequenceSource.CONCAT and sdxl.text_conditioning.pooled_from == 1
    assert flux.text_conditioning.sequence is SequenceSource.SECOND and flux.text_conditioning.pooled_from == 0


def test_unknown_preset_or_device_lists_what_exists():
    with pytest.raises(LoadError, match="tiny-unet, tiny-dit, sdxl-like, flux-like"):
        TextToImagePipeline.from_preset("sd3")
    with pytest.raises(LoadError, match="cpu or meta"):
        TextToImagePipeline.from_preset("tiny-dit", device="cuda")


def test_presets_are_seeded_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = TextToImagePipeline.from_preset("tiny-unet", seed=5)
    assert torch.equal(torch.rand(1), expected_next)
    b = TextToImagePipeline.from_preset("tiny-unet", seed=5)
    c = TextToImagePipeline.from_preset("tiny-unet", seed=6)
    assert torch.equal(a.denoiser.conv_in.weight, b.denoiser.conv_in.weight)
    assert not torch.equal(a.denoiser.conv_in.weight, c.denoiser.conv_in.weight)


def test_encoders_that_do_not_fit_the_denoiser_are_reported(tiny_unet):
    narrow = TextEncoder(TextEncoder.presets["tiny"].model_copy(update={"hidden_size": 16, "projection_dim": None}))
    with pytest.raises(CallError, match=r"hidden sizes \[16\].*text width 32"):
        text_conditioning_for([narrow], tiny_unet.denoiser)
    small_pooled = TextEncoder(TextEncoder.presets["tiny"].model_copy(update={"projection_dim": 16}))
    with pytest.raises(CallError, match=r"pooled text embedding of width 32.*\[16\]"):
        text_conditioning_for([small_pooled], tiny_unet.denoiser)


def test_call_spec_plans_activations_that_grow_with_resolution(tmp_path):
    from pipelines.loading.planning import plan_pipeline

    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    budgets = {0: "4GiB", 1: "4GiB"}
    plans = {size: plan_pipeline(pipe, device_map="balanced", max_memory=budgets, torch_dtype=None,
                                 offload_folder=None, call={"height": size, "width": size}, pinned={})
             for size in (64, 128)}
    assert all(plan.activations_accounted for plan in plans.values())
    small, large = (plans[s].components["denoiser"].activation_bytes for s in (64, 128))
    assert 0 < small < large
    weights_only = plan_pipeline(pipe, device_map="balanced", max_memory=budgets, torch_dtype=None,
                                 offload_folder=None, call=None, pinned={})
    assert not weights_only.activations_accounted


def test_every_call_sends_model_offloaded_components_back_even_a_failed_one(monkeypatch):
    """Model offload leaves the last component on the execution device; `__call__` ends with
    `maybe_free_model_hooks()`, so each call, finished or failed, hands the chain's offload_all one visit."""
    pipe = TextToImagePipeline.from_preset("tiny-dit", seed=0)
    pipe.enable_model_cpu_offload()
    chain_class, visits = type(pipe._model_offload), []
    offload_all = chain_class.offload_all
    monkeypatch.setattr(chain_class, "offload_all", lambda chain: (visits.append("call"), offload_all(chain)))
    generate(pipe)
    assert visits == ["call"]
    with pytest.raises(CallError, match="latents have shape"):
        pipe("a", height=16, width=16, num_inference_steps=1, latents=torch.zeros(1, 1, 1, 1))
    assert visits == ["call", "call"]
    pipe.reset_device_map()


def test_freeing_model_hooks_is_a_no_op_on_a_device_mapped_pipeline(tmp_path):
    from own_fixtures import has_hooks, save_preset

    folder, pipe = save_preset(tmp_path / "tiny-dit")
    with pytest.warns(UserWarning, match="No accelerator"):
        loaded = TextToImagePipeline.from_pretrained(folder, device_map="balanced", progress=False)
    hooks, device_map = has_hooks(loaded), dict(loaded.hf_device_map)
    assert_same_output(generate(loaded), generate(pipe))
    loaded.maybe_free_model_hooks()
    assert has_hooks(loaded) == hooks and loaded.hf_device_map == device_map
    assert {p.device.type for m in loaded.module_components.values() for p in m.parameters()} == {"cpu"}

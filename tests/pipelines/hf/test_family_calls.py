"""call= for the real diffusers families, learned by running each pipeline's own __call__ on stand-ins (call capture):
folders of every family (published configs at depth 1, stand-in tokenizers and schedulers) plan with activations;
the captured calls have the shapes each pipeline really passes (guidance doubling only where it batches); LLM
encoders and HiDream's MoE run on fake tensors; and (slow) the estimate of every component of every family, at
reduced depth and real widths, is within 10% of torch's MemTracker on a real CPU run at three input sizes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._pytree import tree_map_with_path

from family_folders import build_modules, meta_pipeline, write_configs_folder
from pipelines import Pipeline
from pipelines.errors import CallSpecError
from pipelines.loading.planning import describe_call, modules_and_edges
from placement.activations.estimate import measure_activations

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
IMAGE_FAMILIES = ["sd15", "sd21", "sdxl-base-1.0", "sd3-medium", "sd35-large", "flux1-dev", "pixart-sigma-1024",
                  "sana-1600m-1024", "qwen-image", "hidream-i1-full"]
VIDEO_FAMILIES = ["cogvideox-5b", "hunyuanvideo", "wan2.1-t2v-1.3b", "wan2.1-i2v-14b-480p", "ltx-video-0.9"]
# Planned in the default suite: one family per code path that is cheap to build; the rest (same paths, bigger
# text encoders or VAEs) run with --run-slow.
FAST_PLANS = {"sd15", "sdxl-base-1.0", "flux1-dev", "wan2.1-t2v-1.3b"}


def small_call(key: str) -> dict:
    if key in VIDEO_FAMILIES:
        return {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}
    return {"height": 128, "width": 128, "num_inference_steps": 2}


def captured(key: str, call: dict) -> dict:
    """The calls `call` makes of each component of family `key`, captured from its pipeline's own __call__."""
    pipe = meta_pipeline(key)
    modules, _ = modules_and_edges(pipe)
    return describe_call(pipe, modules, call).calls


def _marked(keys):
    return [key if key in FAST_PLANS else pytest.param(key, marks=pytest.mark.slow) for key in keys]


@pytest.mark.parametrize("key", _marked(IMAGE_FAMILIES + VIDEO_FAMILIES))
def test_a_folder_of_each_family_plans_for_its_call(tmp_path, key):
    folder = write_configs_folder(tmp_path / key, key)
    plan = Pipeline.plan_placement(folder, max_memory={0: "80GiB", "cpu": "64GiB"}, torch_dtype=torch.bfloat16,
                                   call=small_call(key))
    assert plan.activations_accounted
    for name, component in plan.components.items():
        assert component.activation_bytes > 0, name
    device = next(d for d in plan.devices if d.device == 0)
    assert device.activation_peak == max(c.activation_bytes for c in plan.components.values()
                                         if c.execution_device == 0)


@pytest.mark.parametrize("key", ["flux1-dev", pytest.param("qwen-image", marks=pytest.mark.slow)])
def test_the_capture_on_one_thread_plans_the_same_as_on_torchs_threads(tmp_path, monkeypatch, key):
    """Issue 38: the capture runs torch on one CPU thread (`capture.one_thread`); on the real configs every peak,
    run per call and FLOP count of the plan is the one planned with torch's threads as they were."""
    from pipelines.hf.calls import capture
    from placement.activations import memo

    folder = write_configs_folder(tmp_path / key, key)
    call = {"height": 1024, "width": 1024, "num_inference_steps": 3}

    def planned() -> dict:
        memo.forget()  # each plan estimated afresh, not answered from the first one's cache
        plan = Pipeline.plan_placement(folder, max_memory={0: "24GiB", "cpu": "64GiB"}, torch_dtype=torch.bfloat16,
                                       call=call)
        return plan.model_dump(mode="json")

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = planned()
        monkeypatch.setattr(capture, "one_thread", contextlib.nullcontext)
        assert planned() == one
    finally:
        torch.set_num_threads(threads)
    assert all(component["activation_bytes"] > 0 for component in one["components"].values())


def _batch(calls, name: str) -> int:
    example = calls[name][0]
    first = example.args[0] if example.args else next(iter(example.kwargs.values()))
    return first.shape[0]


@pytest.mark.parametrize("key, doubles", [("sd15", True), ("sdxl-base-1.0", True), ("flux1-dev", False),
                                          ("wan2.1-t2v-1.3b", False)])
def test_guidance_doubles_the_denoiser_batch_only_where_the_pipeline_batches_negatives(key, doubles):
    denoiser = "unet" if key.startswith("sd") else "transformer"
    per_prompt = "num_videos_per_prompt" if key in VIDEO_FAMILIES else "num_images_per_prompt"
    call = {**small_call(key), "batch_size": 2, per_prompt: 3, "num_inference_steps": 1}
    guided = captured(key, {**call, "guidance_scale": 7.0})
    plain = captured(key, {**call, "guidance_scale": 1.0})
    assert _batch(guided, denoiser) == (12 if doubles else 6)  # Wan runs guidance as a second pass of 6
    assert _batch(plain, denoiser) == 6
    assert _batch(guided, "vae") == 6  # one latent per image, whatever the guidance
    assert _batch(guided, "text_encoder") == 2  # the prompts (negatives are a second call of the same size)


def test_latent_shapes_follow_the_vae_factors_patch_size_and_temporal_compression():
    one_step = {"num_inference_steps": 1}
    transformer = captured("flux1-dev", {"height": 1024, "width": 768, **one_step})["transformer"][0]
    assert transformer.kwargs["hidden_states"].shape == (1, 64 * 48, 64)  # 2x2-packed 16-channel latents of 128x96
    assert transformer.kwargs["encoder_hidden_states"].shape == (1, 512, 4096)
    calls = captured("wan2.1-t2v-1.3b", {"height": 240, "width": 416, "num_frames": 49, **one_step})
    assert calls["transformer"][0].kwargs["hidden_states"].shape == (1, 16, 13, 30, 52)
    assert calls["vae"][0].method == "decode" and calls["vae"][0].args[0].shape == (1, 16, 13, 30, 52)


@pytest.mark.slow
def test_video_latents_of_ltx_and_wan_image_to_video():
    one_step = {"num_inference_steps": 1}
    calls = captured("ltx-video-0.9", {"height": 480, "width": 704, "num_frames": 161, **one_step})
    assert calls["transformer"][0].kwargs["hidden_states"].shape == (2, 21 * 15 * 22, 128)  # 8x, 32x, CFG
    calls = captured("wan2.1-i2v-14b-480p", {"height": 480, "width": 832, "num_frames": 81, **one_step})
    assert [c.method for c in calls["vae"]] == ["encode", "decode"]  # the conditioning video, then the result
    assert calls["transformer"][0].kwargs["encoder_hidden_states_image"].shape == (1, 257, 1280)


def test_a_pipeline_of_unknown_calls_says_how_to_describe_its_inputs():
    from pipelines import Pipeline as Base

    class MyPipeline(Base):
        model_graph = []

    pipe = MyPipeline()
    with pytest.raises(CallSpecError, match="MyPipeline.*activation_inputs"):
        describe_call(pipe, {}, {"height": 512, "width": 512})


@pytest.mark.parametrize("call, message", [
    ({"height": 1024, "width": 1024, "resolution": 4}, "unknown keyword 'resolution'"),
    ({"height": 1024, "width": 1024, "num_inference_step": 4}, "'num_inference_step' .did you mean "
                                                                 "'num_inference_steps'"),
    ({"height": 1024, "width": 1024, "batch_size": 0}, "batch_size must be a positive int"),
    ({"height": 1024, "width": 1024, "max_sequence_length": 1024}, "refuses this call.*max_sequence_length"),
])
def test_a_call_the_pipeline_would_reject_is_refused_with_the_key_and_value(call, message):
    with pytest.raises(CallSpecError, match=message):
        captured("flux1-dev", {**call, "num_inference_steps": 1})


def test_the_cli_plans_a_diffusers_folder_for_a_video_call(tmp_path, capsys):
    from pipelines.cli import main

    folder = write_configs_folder(tmp_path / "wan", "wan2.1-t2v-1.3b")
    code = main(["plan", str(folder), "--max-memory", "0=24GiB,cpu=64GiB", "--dtype", "bf16", "--height", "64",
                 "--width", "64", "--num-frames", "9", "--max-sequence-length", "128", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "num_frames=9" in out and "max_sequence_length=128" in out


# ------------------------------------------------------------------------------------- fake-tensor stand-ins
def _tiny_llm(kind: str):
    import transformers

    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)
    if kind == "llama":
        return transformers.LlamaModel(transformers.LlamaConfig(**common))
    if kind == "gemma2":
        return transformers.Gemma2Model(transformers.Gemma2Config(**common, head_dim=32))
    config = transformers.Qwen2_5_VLConfig(text_config=dict(common, rope_scaling={"type": "mrope",
                                                                                  "mrope_section": [4, 6, 6]}),
                                           vision_config=dict(depth=1, hidden_size=64, intermediate_size=128,
                                                              num_heads=2, out_hidden_size=128))
    return transformers.Qwen2_5_VLForConditionalGeneration(config)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "qwen2.5-vl"])
def test_llm_encoders_are_estimated_with_their_kv_cache_as_pipelines_call_them(kind):
    from pipelines.hf.calls.capture import ExampleCall

    torch.manual_seed(0)
    encoder = _tiny_llm(kind).eval()
    ids, mask = torch.empty(2, 48, dtype=torch.long, device="meta"), torch.empty(2, 48, dtype=torch.long, device="meta")
    call = ExampleCall(kwargs={"input_ids": ids, "attention_mask": mask, "output_hidden_states": True})
    estimate = call.estimate(encoder)
    measured = measure_activations(encoder, *real_inputs(call))
    assert abs(estimate - measured) <= 0.10 * measured, (estimate, measured)
    without_cache = type(call)(args=call.args, kwargs={**call.kwargs, "use_cache": False}).estimate(encoder)
    assert without_cache < estimate  # the cache the pipeline's call allocates is counted


def test_hidream_moe_is_estimated_by_its_worst_case_routing():
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    from pipelines.hf.calls.capture import ExampleCall

    torch.manual_seed(0)
    moe = MOEFeedForwardSwiGLU(dim=64, hidden_dim=256, num_routed_experts=4, num_activated_experts=2).eval()
    call = ExampleCall(args=(torch.empty(2, 96, 64, device="meta"),))
    estimate = call.estimate(moe)
    x = torch.randn(2, 96, 64)
    balanced = measure_activations(moe, (x,))
    assert estimate >= balanced
    # Routing every token to experts 0 and 1 (a routing the gate can produce) is what the estimate assumes.
    gate = moe.gate
    tokens = 2 * 96
    gate.forward = lambda h: (torch.tensor([[0, 1]] * tokens), torch.full((tokens, 2), 0.5), None)
    skewed = measure_activations(moe, (x,))
    assert abs(estimate - skewed) <= 0.10 * skewed, (estimate, skewed)


# --------------------------------------------------------------------------------- accuracy (slow, real widths)
def real_inputs(call):
    """Real tensors of the call's shapes: noise, token ids of ones, and attention masks as a tokenizer pads a
    short prompt (the first 8 positions valid). A mask of all ones would let transformers skip building the
    4-d mask (it checks the values), which a padded prompt, the common case, never does."""

    def materialize(path, meta):
        if not isinstance(meta, torch.Tensor):
            return meta
        if meta.is_floating_point():
            return torch.randn(meta.shape, dtype=meta.dtype)
        values = torch.ones(meta.shape, dtype=meta.dtype)
        if "mask" in str(path[-1]) and meta.dim() == 2:
            values[:, 8:] = 0
        return values

    return tree_map_with_path(materialize, (call.args, dict(call.kwargs)))


ACCURACY_SIZES = {
    "image": [{"height": 64, "width": 64}, {"height": 64, "width": 128}, {"height": 128, "width": 128}],
    "video": [{"height": 32, "width": 32, "num_frames": 5}, {"height": 32, "width": 64, "num_frames": 5},
              {"height": 64, "width": 64, "num_frames": 5}],
    "ltx": [{"height": 32, "width": 32, "num_frames": 9}, {"height": 32, "width": 64, "num_frames": 9},
            {"height": 64, "width": 64, "num_frames": 9}],
}


# Causal video VAEs that decode one latent frame at a time call the same blocks once per frame, and MemTracker
# refuses repeated calls of a module ("multiple iterative calls"): no reference to compare with on the CPU.
MEMTRACKER_CANNOT_MEASURE = {"AutoencoderKLWan", "AutoencoderKLQwenImage"}


def route_to_first_experts(module: torch.nn.Module) -> torch.nn.Module:
    """Every MoE gate of `module` routes each token to experts 0..k-1: a routing the gate can produce, and the
    one the estimate assumes (placement/activations/fake_tensors.py), so estimate and run compare like with like
    (random weights route evenly, which peaks lower: the estimate is an upper bound)."""
    for sub in module.modules():
        if not callable(getattr(type(sub), "moe_infer", None)):
            continue
        gate, activated = sub.gate, sub.num_activated_experts
        if isinstance(activated, int):
            def first_experts(hidden, k=activated):
                tokens = hidden.shape[0] * hidden.shape[1]
                return torch.arange(k).repeat(tokens, 1), torch.full((tokens, k), 1.0 / k, dtype=hidden.dtype), None
            gate.forward = first_experts
    return module


def _sizes(key: str) -> list[dict]:
    return ACCURACY_SIZES["ltx" if key.startswith("ltx") else "video" if key in VIDEO_FAMILIES else "image"]


@pytest.mark.slow
@pytest.mark.parametrize("key", IMAGE_FAMILIES + VIDEO_FAMILIES)
def test_estimates_are_within_ten_percent_of_a_real_cpu_run_at_three_sizes(key):
    pipe = meta_pipeline(key)
    on_meta, _ = modules_and_edges(pipe)
    _, real = build_modules(key, device="cpu")
    real = {name: route_to_first_experts(module) for name, module in real.items()}
    for call in _sizes(key):
        for name, runs in describe_call(pipe, on_meta, {**call, "num_inference_steps": 1}).calls.items():
            if type(real[name]).__name__ in MEMTRACKER_CANNOT_MEASURE:
                continue
            for example in runs:
                estimate = example.estimate(on_meta[name])
                args, kwargs = real_inputs(example)
                measured = measure_activations(real[name], args, kwargs, method=example.method)
                assert abs(estimate - measured) <= 0.10 * measured, (key, call, name, example.method, estimate,
                                                                     measured)

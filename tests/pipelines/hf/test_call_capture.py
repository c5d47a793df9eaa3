"""Call capture on tiny diffusers pipelines: what a capture passes to the pipeline's own `__call__`. An image input
the call does not give stays the pipeline's default (FLUX.2 klein's text-to-image is not planned as an edit), one
the pipeline cannot run without gets a blank stand-in (also without call=, whose default call is small); the
user's generator, callbacks, latents and images are read, never used or changed; a call that would fill the host
is refused before any work; and a strength that leaves no denoising step gets the answer that says so."""

from __future__ import annotations

import contextlib

import diffusers
import pytest
import torch
import transformers

import tiny_dits
import tiny_unets
import tiny_videos
from cases import image
from pipelines.errors import CallSpecError
from pipelines.hf.calls import host_memory
from pipelines.hf.calls.arguments import SMALL_SIDE
from pipelines.loading.planning import describe_call, modules_and_edges
from test_e2e_diffusers import two_virtual_gpus  # noqa: F401 (autouse: diffusers' Wan ftfy stand-in)
from tiny_dits import CHAT_TEMPLATE
from tiny_parts import LLM_VOCAB, llm_tokenizer, seeded, t5_encoder, t5_tokenizer, wan_vae

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
TEXT = {"prompt": "a cat", "max_sequence_length": 8}


def flux2_klein(root=None):
    """FLUX.2 klein: a Qwen3 encoder whose layers 0-2 are stacked (text_encoder_out_layers), a one-block VAE (no
    downsampling, 2x2 patches), a transformer of one block of each kind."""
    tokenizer = llm_tokenizer("Qwen2TokenizerFast")
    tokenizer.chat_template = CHAT_TEMPLATE
    encoder = seeded(lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=8, intermediate_size=8, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        head_dim=4, vocab_size=LLM_VOCAB, max_position_embeddings=512)).eval())
    transformer = seeded(lambda: diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=24, timestep_guidance_channels=8, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False))
    vae = seeded(lambda: diffusers.AutoencoderKLFlux2(
        block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32))
    return diffusers.Flux2KleinPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                        text_encoder=encoder, tokenizer=tokenizer, transformer=transformer,
                                        is_distilled=True)


def chronoedit(root=None):
    """ChronoEdit: Wan image-to-video's parts, its `image` a required argument of `__call__`."""
    vision = transformers.CLIPVisionConfig(hidden_size=4, projection_dim=4, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, intermediate_size=16, patch_size=8)
    return diffusers.ChronoEditPipeline(
        transformer=seeded(lambda: diffusers.ChronoEditTransformer3DModel(
            **{**tiny_videos.WAN_TRANSFORMER, "in_channels": 36}, image_dim=4)),
        vae=seeded(wan_vae), text_encoder=seeded(lambda: t5_encoder(transformers.UMT5EncoderModel)),
        tokenizer=t5_tokenizer(), image_encoder=seeded(lambda: transformers.CLIPVisionModel(vision)),
        image_processor=transformers.CLIPImageProcessor(crop_size=32, size=32),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))


KLEIN = {**TEXT, "num_inference_steps": 2, "text_encoder_out_layers": (0, 1, 2)}


def described(pipe, call):
    modules, _ = modules_and_edges(pipe)
    return describe_call(pipe, modules, call)


def _tokens(calls) -> int:
    return calls["transformer"][0].kwargs["hidden_states"].shape[1]


def test_an_image_input_the_call_does_not_give_stays_the_pipelines_default():
    pipe = flux2_klein()
    call = {**KLEIN, "height": 32, "width": 32}  # below the 64 px klein asks of a conditioning image
    pipe(**call, output_type="pt")  # diffusers runs it: text-to-image
    text_to_image = described(pipe, call).calls
    assert [c.method for c in text_to_image["vae"]] == ["decode"]  # no image encoded
    assert _tokens(text_to_image) == 16 * 16  # 2x2-packed latents of 32x32, no image tokens beside them
    edit = described(pipe, {**KLEIN, "height": 64, "width": 64, "image": (64, 64)}).calls
    assert [c.method for c in edit["vae"]] == ["encode", "decode"]
    assert _tokens(edit) == 2 * 32 * 32  # the image's tokens beside the latents': an edit is twice the work


@pytest.mark.parametrize("build, call, runs", [
    # SD3 ControlNet cannot run without its control image: a blank one of the call's size, a ControlNet run per step
    (tiny_dits.sd3_controlnet, {"height": 16, "width": 16, "num_inference_steps": 3},
     {"transformer": 3, "controlnet": 3}),
    # nor SD's ControlNet without its `image`
    (tiny_unets.sd_controlnet, {"height": 16, "width": 16, "num_inference_steps": 3}, {"unet": 3, "controlnet": 3}),
    # ChronoEdit's `image` has no default: guidance as a second pass
    (chronoedit, {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 3, "max_sequence_length": 8},
     {"image_encoder": 1, "transformer": 6}),
])
def test_an_image_input_the_pipeline_needs_gets_a_stand_in(tmp_path, build, call, runs):
    captured = described(build(tmp_path), {"prompt": "a cat", **call}).runs
    assert {name: captured.get(name) for name in runs} == runs


@pytest.mark.parametrize("build, runs", [
    # each pipeline's default steps, guidance passes and all; Wan VACE runs without a video (its own blank one)
    (tiny_dits.sd3_controlnet, {"transformer": 28, "controlnet": 28}),
    (tiny_unets.sd_controlnet, {"unet": 50, "controlnet": 50}),
    (tiny_videos.wan_vace, {"transformer": 100}),  # 50 steps, guidance as a second pass
    (tiny_videos.ltx, {"transformer": 50}),
    (chronoedit, {"transformer": 100, "image_encoder": 1}),  # its required image: a blank one
])
def test_without_call_the_default_call_counts_each_components_runs_at_a_small_size(tmp_path, monkeypatch, build,
                                                                                    runs):
    from pipelines.hf.calls import capture

    sizes = []
    original = capture.call_arguments

    def noted(pipeline_class, call, **keywords):
        sizes.append((call.get("height"), call.get("width")))
        return original(pipeline_class, call, **keywords)

    monkeypatch.setattr(capture, "call_arguments", noted)
    calls = described(build(tmp_path), None)
    assert {name: calls.runs.get(name) for name in runs} == runs
    # planned at SMALL_SIDE (or a divisor of the pipeline's default sizes): seconds, not the full default size
    assert sizes and all(0 < side <= SMALL_SIDE for size in sizes for side in size)


def test_planning_leaves_the_users_generator_callbacks_and_tensors_as_they_were(tmp_path):
    pipe = tiny_dits.pixart(tmp_path)
    call = {**TEXT, "height": 16, "width": 16, "num_inference_steps": 2, "use_resolution_binning": False}
    before = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pt").images
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3))
    kept = latents.clone()
    called = []
    described(pipe, {**call, "generator": generator, "latents": latents, "callback_steps": 1,
                     "callback": lambda *args: called.append(args)})
    assert torch.equal(generator.get_state(), state)  # not advanced
    assert called == []  # the legacy callback: never called
    assert torch.equal(latents, kept)  # read, not written
    after = pipe(**call, generator=generator, output_type="pt").images
    assert torch.equal(after, before)  # the user's next call makes the image it would have made


def test_a_callback_on_step_end_is_not_called_while_planning(tmp_path):
    called = []

    def on_step_end(pipe, step, timestep, tensors):
        called.append(step)
        return tensors

    runs = described(tiny_unets.sd_img2img(tmp_path), {"prompt": "a cat", "image": image(16), "strength": 0.5,
                                                      "num_inference_steps": 4,
                                                      "callback_on_step_end": on_step_end}).runs
    assert runs["unet"] == 2 and called == []  # int(4 x 0.5) steps, guidance batched


SIZES = {**TEXT, "height": 16, "width": 16, "use_resolution_binning": False}


def test_a_call_too_large_for_the_host_is_refused_before_any_work(tmp_path, monkeypatch):
    pipe = tiny_dits.pixart(tmp_path)
    modules, _ = modules_and_edges(pipe)
    ran = []
    monkeypatch.setattr(type(pipe), "encode_prompt", lambda *args, **kwargs: ran.append(1))
    with pytest.raises(CallSpecError, match=r"10,000,000 x 1 frame\(s\) of 16x16 pixels.*Nothing was run"):
        describe_call(pipe, modules, {**SIZES, "num_images_per_prompt": 10**7})
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 4 * 2**20)  # a host with 4 MiB free
    with pytest.raises(CallSpecError, match=r"2,000 x 1 frame\(s\) of 16x16.*2,000 x 8 tokens x 32 .*more than "
                                            r"the 3.20 MiB it may take"):
        describe_call(pipe, modules, {**SIZES, "batch_size": 2000})
    assert ran == []


def test_a_blank_output_that_would_fill_the_host_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    pipe = tiny_dits.pixart(tmp_path)
    monkeypatch.setattr("pipelines.hf.calls.capture.check_host_room", lambda *args: None)  # past the first check
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 2**20)
    with pytest.raises(CallSpecError, match=r"text_encoder.forward's output needs .* Nothing more was allocated"):
        described(pipe, {**SIZES, "batch_size": 2000})


def test_a_strength_that_leaves_no_denoising_step_is_said_so(tmp_path):
    pipe = tiny_unets.sd_img2img(tmp_path)
    call = {"prompt": "a cat", "image": image(16), "num_inference_steps": 2, "strength": 0.2}
    with pytest.raises(RuntimeError):  # diffusers' own call fails too: an empty batch in the VAE's decode
        pipe(**call, output_type="pt")
    with pytest.raises(CallSpecError, match=r"strength=0.2 of num_inference_steps=2 leaves no denoising step .*"
                                            r"at least 0.5 or at least 5 num_inference_steps"):
        described(pipe, call)


def test_cogviews_glm_encoder_is_planned_at_its_real_sequence_lengths(tmp_path):
    """CogView4 pads GLM's ids to a multiple of 16; GLM's tokenizer puts `[gMASK]<sop>` before every text, so its
    default negative prompt "" is 16 ids, and the prompt the longest the call allows."""
    calls = described(tiny_dits.cogview4(tmp_path), {"height": 1024, "width": 1024, "num_inference_steps": 1})
    assert sorted(example.args[0].shape[1] for example in calls.calls["text_encoder"]) == [16, 1024]


def test_a_tokenizer_that_gives_no_token_is_named_as_the_cause(tmp_path):
    pipe = tiny_dits.cogview4(tmp_path)
    pipe.tokenizer = llm_tokenizer("PreTrainedTokenizerFast")  # without GLM's prefix: "" is no token
    call = {"prompt": "a cat", "height": 32, "width": 32, "num_inference_steps": 1}
    with pytest.raises(RuntimeError):
        pipe(**call, output_type="pt")  # diffusers' own call fails too
    with pytest.raises(CallSpecError, match=r"text_encoder was called on a sequence of no tokens \(int64\[1, 0\]\)"
                                            r".*non-empty negative_prompt"):
        described(pipe, call)


def test_a_plan_made_with_the_users_objects_in_call_leaves_them_alone(tmp_path):
    from pipelines import Pipeline

    tiny_dits.pixart(tmp_path / "parts").save_pretrained(tmp_path / "pixart")
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    called = []
    plan = Pipeline.plan_placement(tmp_path / "pixart", max_memory={0: "1GiB", "cpu": "2GiB"},
                                   call={**SIZES, "num_inference_steps": 2, "generator": generator,
                                         "callback": lambda *args: called.append(args)})
    assert plan.activations_accounted and plan.components["transformer"].activation_bytes > 0
    assert torch.equal(generator.get_state(), state) and called == []
    assert plan.inputs.call["height"] == 16  # the plan records the call (the objects by their repr)


def test_an_img2img_call_too_large_for_the_host_is_sized_by_its_image_and_tokenizer(tmp_path):
    """SD img2img takes its size from the image and pads prompts to CLIP's length: both weigh in."""
    with pytest.raises(CallSpecError, match=r"10,000,000 x 1 frame\(s\) of 16x16 pixels.*10,000,000 x 16 tokens"):
        described(tiny_unets.sd_img2img(tmp_path), {"prompt": "a cat", "image": image(16),
                                                    "num_images_per_prompt": 10**7})


def test_the_capture_runs_torch_on_one_thread_and_describes_the_same_call(tmp_path, monkeypatch):
    """The capture's real tensors (latents, the scheduler's steps) run on one CPU thread (issue 38: on a loaded
    2-core machine OpenMP's threads cost more than the arithmetic): the call it describes is the one described
    with torch's threads as they were, and the setting is given back, also when the pipeline refuses the call."""
    from pipelines.hf.calls import capture

    pipe = tiny_dits.pixart(tmp_path)
    call = {**SIZES, "num_inference_steps": 3}
    seen = []
    step = type(pipe.scheduler).step
    monkeypatch.setattr(type(pipe.scheduler), "step",
                        lambda *args, **kwargs: (seen.append(torch.get_num_threads()), step(*args, **kwargs))[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = described(pipe, call)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setattr(capture, "one_thread", contextlib.nullcontext)
        two = described(pipe, call)
        assert set(seen) == {2}
        monkeypatch.undo()
        with pytest.raises(CallSpecError):  # PixArt refuses sizes not divisible by 8
            described(pipe, {**call, "height": 15})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert (one.runs, dict(one.peaks), dict(one.work), dict(one.module_order)) == \
        (two.runs, dict(two.peaks), dict(two.work), dict(two.module_order))
    assert {name: [(c.method, [tuple(a.shape) for a in c.args if isinstance(a, torch.Tensor)]) for c in calls]
            for name, calls in one.calls.items()} == \
        {name: [(c.method, [tuple(a.shape) for a in c.args if isinstance(a, torch.Tensor)]) for c in calls]
         for name, calls in two.calls.items()}

"""TextToImagePipeline's per-component example inputs, and the activation estimate of every reference model
against a real run: on CPU (tiny presets, three sizes) and on a GPU (real widths, 512 and 1024; marked)."""

import pytest
import torch
from torch.utils._pytree import tree_map_only

from pipelines.errors import LoadError
from pipelines.text_to_image.pipeline import ComponentCall, TextToImagePipeline, text_to_image_activation_inputs
from placement.activations.estimate import measure_activations

SIDES = (32, 64, 128)  # pixels; the tiny VAE downsamples by 2, so latents are 16..64 a side


@pytest.fixture(scope="module", params=["tiny-unet", "tiny-dit"])
def pipelines_pair(request):
    """The same preset twice: on meta (what planning estimates from) and with real weights (what runs)."""
    return (
        TextToImagePipeline.from_preset(request.param, device="meta"),
        TextToImagePipeline.from_preset(request.param, device="cpu", seed=0),
    )


def real_inputs(call: ComponentCall, device="cpu", generator=None):
    """Real tensors of the call's shapes: token ids and masks of ones (valid for any vocabulary), noise."""

    def materialize(meta: torch.Tensor) -> torch.Tensor:
        if meta.is_floating_point():
            return torch.randn(meta.shape, dtype=meta.dtype, device=device, generator=generator)
        return torch.ones(meta.shape, dtype=meta.dtype, device=device)

    return tree_map_only(torch.Tensor, materialize, (call.args, dict(call.kwargs)))


def test_estimate_is_within_ten_percent_of_a_real_run_at_three_sizes(pipelines_pair):
    on_meta, real = pipelines_pair
    for side in SIDES:
        calls = text_to_image_activation_inputs(on_meta, side, side, guidance_scale=4.0)
        for name, call in calls.items():
            estimate = call.estimate(getattr(on_meta, name))
            args, kwargs = real_inputs(call)
            measured = measure_activations(getattr(real, name), args, kwargs, method=call.method)
            assert measured > 0
            assert abs(estimate - measured) <= 0.10 * measured, (name, side, estimate, measured)


def test_estimates_grow_with_resolution_as_the_architectures_imply(pipelines_pair):
    on_meta, _ = pipelines_pair
    small, large = (
        {name: call.estimate(getattr(on_meta, name)) for name, call in
         text_to_image_activation_inputs(on_meta, side, side).items()}
        for side in (64, 128)
    )
    for name in ("text_encoder", "text_encoder_2"):
        if name in small:
            assert small[name] == large[name]  # the prompt's length, not the image's size
    # Conv feature maps and (fused-attention) token sequences both scale with the pixel count: 2x the side is
    # 4x the bytes. The DiT's fixed text tokens keep it slightly under 4x; an N x N attention would give ~16x.
    assert 3.9 <= large["vae"] / small["vae"] <= 4.1
    assert 3.5 <= large["denoiser"] / small["denoiser"] <= 4.1


def test_guidance_doubles_the_denoiser_and_text_batches_only():
    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    guided = text_to_image_activation_inputs(pipe, 64, 64, batch_size=3, num_images_per_prompt=2, guidance_scale=5.0)
    plain = text_to_image_activation_inputs(pipe, 64, 64, batch_size=3, num_images_per_prompt=2, guidance_scale=1.0)
    latents, timestep, sequence = guided["denoiser"].args
    assert latents.shape == (12, pipe.denoiser.config.in_channels, 32, 32) and latents.is_meta
    assert timestep.shape == ()
    assert sequence.shape[0] == 12 and guided["denoiser"].kwargs["pooled"].shape[0] == 12
    assert guided["text_encoder"].args[0].shape[0] == 12
    assert plain["denoiser"].args[0].shape[0] == 6 and plain["text_encoder"].args[0].shape[0] == 6
    for calls in (guided, plain):
        assert calls["vae"].method == "decode"
        assert calls["vae"].args[0].shape == (6, pipe.vae.config.latent_channels, 32, 32)


def test_text_encoders_see_the_tokenizers_max_length_and_the_denoiser_the_combined_text():
    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    calls = text_to_image_activation_inputs(pipe, 64, 64)
    for name in ("text_encoder", "text_encoder_2"):
        length = getattr(pipe, name).config.max_position_embeddings
        assert calls[name].args[0].shape[1] == length and calls[name].args[0].dtype == torch.long
        assert calls[name].kwargs["attention_mask"].shape == calls[name].args[0].shape
    # Flux layout: the second (T5-like) encoder is the sequence, the first (CLIP-like) gives the pooled vector.
    _, _, sequence = calls["denoiser"].args
    assert sequence.shape[1:] == (pipe.text_encoder_2.config.max_position_embeddings,
                                  pipe.denoiser.config.joint_attention_dim)
    assert calls["denoiser"].kwargs["pooled"].shape[1] == pipe.denoiser.config.pooled_projection_dim


def test_inputs_follow_the_components_dtype():
    pipe = TextToImagePipeline.from_preset("tiny-unet", device="meta")
    pipe.denoiser.to(torch.bfloat16)
    calls = text_to_image_activation_inputs(pipe, 64, 64)
    assert calls["denoiser"].args[0].dtype == torch.bfloat16 and calls["denoiser"].args[2].dtype == torch.bfloat16
    assert calls["vae"].args[0].dtype == torch.float32


def test_an_offloaded_vae_decode_is_estimated_like_a_plain_one():
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    pipe = TextToImagePipeline.from_preset("tiny-unet", device="cpu")
    call = text_to_image_activation_inputs(pipe, 64, 64)["vae"]
    plain = call.estimate(pipe.vae)
    cpu_offload(pipe.vae, execution_device=torch.device("cpu"))
    try:
        assert call.estimate(pipe.vae) == plain
        assert pipe.vae._hf_hook is not None  # still offloaded afterwards
    finally:
        remove_hook_from_module(pipe.vae, recurse=True)


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(height=66, width=64), r"height=66 must be a positive multiple of 4.*try 64"),
        (dict(height=64, width=0), r"width=0"),
        (dict(height=64, width=64, batch_size=0), r"batch_size must be a positive int, got 0"),
        (dict(height=64, width=64, num_images_per_prompt=1.5), r"num_images_per_prompt"),
    ],
)
def test_bad_call_specs_are_clear_errors(spec, message):
    pipe = TextToImagePipeline.from_preset("tiny-unet", device="meta")
    with pytest.raises(LoadError, match=message):
        text_to_image_activation_inputs(pipe, **spec)


# --- the call spec's batch arithmetic: num_images_per_prompt, batch_size > 1, guidance_scale <= 1 ---------

SPECS = [  # (prompts, images per prompt, guidance_scale): CFG on and off, at and below 1
    (1, 1, 4.0), (2, 3, 4.0), (2, 1, 1.0), (1, 2, 0.0), (3, 1, 0.5),
]


def _shapes(tree):
    """(shape, dtype) of every tensor in a call's args/kwargs, in order; other leaves as they are."""
    from torch.utils._pytree import tree_leaves

    return [(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in tree_leaves(tree)]


def _captured_call(pipe, prompts: int, per_prompt: int, guidance_scale: float, monkeypatch) -> dict[str, list]:
    """What a real `pipe(...)` call feeds each component: the shapes of the first call of each."""
    seen: dict[str, list] = {}
    handles = []
    for name in ("text_encoder", "text_encoder_2", "denoiser"):
        module = getattr(pipe, name, None)
        if module is not None:
            def record(module, args, kwargs, name=name):
                seen.setdefault(name, _shapes((args, kwargs)))
            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    decode = pipe.vae._decode

    def record_decode(latents):
        seen.setdefault("vae", _shapes(((latents,), {})))
        return decode(latents)

    monkeypatch.setattr(pipe.vae, "_decode", record_decode)
    try:
        with torch.no_grad():
            pipe(["a red square"] * prompts, num_images_per_prompt=per_prompt, guidance_scale=guidance_scale,
                 height=32, width=48, num_inference_steps=1, output_type="pt")
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("preset", ["tiny-unet", "tiny-dit"])
@pytest.mark.parametrize("prompts, per_prompt, guidance_scale", SPECS)
def test_inputs_are_exactly_what_a_real_call_feeds_each_component(preset, prompts, per_prompt, guidance_scale,
                                                                  monkeypatch):
    pipe = TextToImagePipeline.from_preset(preset, seed=0)
    calls = text_to_image_activation_inputs(pipe, 32, 48, batch_size=prompts, num_images_per_prompt=per_prompt,
                                            guidance_scale=guidance_scale)
    seen = _captured_call(pipe, prompts, per_prompt, guidance_scale, monkeypatch)
    assert set(seen) == set(calls)
    for name, call in calls.items():
        assert _shapes((call.args, dict(call.kwargs))) == seen[name], name
    images, guided = prompts * per_prompt, guidance_scale > 1
    assert calls["denoiser"].args[0].shape[0] == images * (2 if guided else 1)
    assert calls["vae"].args[0].shape[0] == images


def _estimates(pipe, **spec) -> dict[str, int]:
    calls = text_to_image_activation_inputs(pipe, 64, 64, **spec)
    return {name: call.estimate(getattr(pipe, name)) for name, call in calls.items()}


def test_estimates_depend_on_images_and_guidance_not_on_how_the_batch_is_asked_for():
    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    # Two prompts x one image and one prompt x two images are the same tensors for every component.
    assert _estimates(pipe, batch_size=2) == _estimates(pipe, num_images_per_prompt=2)
    # guidance_scale <= 1 runs no classifier-free guidance, wherever below 1 it is.
    unguided = _estimates(pipe, batch_size=2, guidance_scale=1.0)
    assert _estimates(pipe, batch_size=2, guidance_scale=0.0) == unguided
    assert _estimates(pipe, batch_size=2, guidance_scale=0.5) == unguided
    # One guided image puts two samples through the encoders and the denoiser, like two unguided images, but
    # the VAE decodes one.
    guided = _estimates(pipe, batch_size=1, guidance_scale=1.5)
    for name in ("text_encoder", "text_encoder_2", "denoiser"):
        assert guided[name] == unguided[name], name
    assert guided["vae"] < unguided["vae"]


def test_estimates_scale_with_the_number_of_samples():
    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    one = _estimates(pipe, guidance_scale=1.0)
    four = _estimates(pipe, batch_size=2, num_images_per_prompt=2, guidance_scale=1.0)
    guided_four = _estimates(pipe, batch_size=2, num_images_per_prompt=2, guidance_scale=4.0)
    # Every activation carries the batch dimension (the 0-d timestep and its embedding are the exception).
    for name in one:
        assert 3.8 <= four[name] / one[name] <= 4.0, (name, one[name], four[name])
    assert 1.9 <= guided_four["denoiser"] / four["denoiser"] <= 2.0
    assert guided_four["vae"] == four["vae"]


@pytest.mark.parametrize("prompts, per_prompt, guidance_scale", [(2, 2, 4.0), (3, 1, 1.0)])
def test_batched_estimates_are_within_ten_percent_of_a_real_run(pipelines_pair, prompts, per_prompt,
                                                                 guidance_scale):
    on_meta, real = pipelines_pair
    calls = text_to_image_activation_inputs(on_meta, 64, 64, batch_size=prompts, num_images_per_prompt=per_prompt,
                                            guidance_scale=guidance_scale)
    for name, call in calls.items():
        estimate = call.estimate(getattr(on_meta, name))
        args, kwargs = real_inputs(call)
        measured = measure_activations(getattr(real, name), args, kwargs, method=call.method)
        assert abs(estimate - measured) <= 0.10 * measured, (name, estimate, measured)



@pytest.mark.filterwarnings("ignore:No accelerator to plan for")
def test_a_plan_for_a_call_shows_each_components_activations_and_each_devices_peak(tmp_path):
    """What `plan_placement(call=)` (and `placement plan --height/--width/--batch-size`) show a user: each
    component's activation peak for that call, and per device weights + the largest of them + overhead."""
    from placement.sizes import format_bytes

    TextToImagePipeline.from_preset("tiny-dit").save_pretrained(tmp_path / "tiny-dit")
    spec = {"height": 64, "width": 64, "batch_size": 2, "num_images_per_prompt": 2, "guidance_scale": 1.0}
    plan = TextToImagePipeline.plan_placement(tmp_path / "tiny-dit", max_memory={0: "4GiB", 1: "4GiB"}, call=spec)
    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    assert plan.activations_accounted
    for name, call in pipe.activation_inputs(**spec).items():
        assert plan.components[name].activation_bytes == call.estimate(getattr(pipe, name)), name
    for device in plan.devices:
        running = [c.activation_bytes for c in plan.components.values() if c.execution_device == device.device]
        assert device.activation_peak == max(running, default=0), device
        assert device.predicted_peak == device.weight_bytes + device.activation_peak + device.overhead

    lines = plan.explain().splitlines()
    header = next(line for line in lines if line.startswith("component"))
    assert header.split()[:6] == ["component", "kind", "dtype", "runs", "on", "activations"]
    for name, component in plan.components.items():
        row = next(line for line in lines if line.startswith(f"{name} "))
        assert component.dtype in row, row  # e.g. "float32 (checkpoint)": several words, read apart
        assert row.replace(component.dtype, "", 1).split()[4:6] == format_bytes(component.activation_bytes).split()
    for device in plan.accelerators:
        row = next(line for line in lines if line.startswith(f"GPU {device} "))  # the device table's row
        assert format_bytes(plan.device(device).predicted_peak) in row, row



@pytest.mark.filterwarnings("ignore:No accelerator to plan for")
def test_placement_plan_cli_plans_for_images_per_prompt_and_guidance(tmp_path, capsys):
    from pipelines.cli import main
    from placement import Plan

    target = tmp_path / "plan.json"
    folder = tmp_path / "tiny-dit"  # the CLI's presets are diffusers' folders: this one is saved and planned as a folder
    TextToImagePipeline.from_preset("tiny-dit", seed=0).save_pretrained(folder)
    code = main(["plan", str(folder), "--max-memory", "0=1GiB,1=1GiB", "--height", "64", "--width", "64",
                 "--batch-size", "2", "--num-images-per-prompt", "3", "--guidance-scale", "1", "--json", str(target)])
    assert code == 0
    out = capsys.readouterr().out
    assert "Planned for the call: height=64, width=64, batch_size=2, num_images_per_prompt=3, guidance_scale=1.0" in out
    plan = Plan.from_json(target.read_text())
    pipe = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    calls = pipe.activation_inputs(64, 64, batch_size=2, num_images_per_prompt=3, guidance_scale=1.0)
    for name, call in calls.items():
        assert plan.components[name].activation_bytes == call.estimate(getattr(pipe, name)), name
    assert calls["denoiser"].args[0].shape[0] == 6  # no guidance: one sample per image


# --- GPU: predicted vs torch.cuda.max_memory_allocated at 512 and 1024 ------------------------------------

# Real widths; the transformer stacks are shortened because the activation peak of a stack is that of one
# block plus the stream it carries — depth changes the weights, not the peak — and it keeps the test quick.
GPU_PRESETS = ("sdxl-like", "flux-like")


def _shortened(module):
    """The module's class with its config's transformer stacks cut to two blocks, built on meta."""
    from pipelines.text_to_image.models import DiT, UNet

    update = {}
    if isinstance(module, DiT):
        update = dict(num_double_layers=2, num_single_layers=2)
    elif isinstance(module, UNet):
        update = dict(transformer_layers_per_block=(0, 2, 2), mid_transformer_layers=2)
    with torch.device("meta"):
        return type(module)(module.config.model_copy(update=update)).eval()


def _gpu_peak(module_on_meta, call: ComponentCall, dtype) -> int:
    """Build the module on the GPU, run the call for real, return the peak bytes above the weights."""
    device = torch.device("cuda")
    with torch.device(device):
        module = type(module_on_meta)(module_on_meta.config)
    module.to(dtype=dtype).eval()
    # cuBLAS allocates its workspace on the first matmul and keeps it: a per-device overhead the planner adds
    # once, not part of any call's activations. Allocate it before the baseline.
    warm = torch.ones(64, 64, device=device, dtype=dtype)
    torch.mm(warm, warm)
    del warm
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    generator = torch.Generator(device=device).manual_seed(0)
    args, kwargs = real_inputs(call, device=device, generator=generator)
    args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # from here: weights + inputs, as the estimate counts them
    with torch.inference_mode():
        getattr(module, call.method)(*args, **kwargs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - weights
    del module, args, kwargs
    torch.cuda.empty_cache()
    return peak


@pytest.mark.gpu
@pytest.mark.parametrize("preset", GPU_PRESETS)
@pytest.mark.parametrize("side", [512, 1024])
def test_estimate_is_within_fifteen_percent_of_cuda_max_memory_allocated(preset, side):
    dtype = torch.bfloat16
    pipe = TextToImagePipeline.from_preset(preset, device="meta")
    calls = text_to_image_activation_inputs(pipe, side, side)
    for name in ("denoiser", "vae"):
        module = _shortened(getattr(pipe, name))
        estimate = calls[name].estimate(module, dtype=dtype)
        measured = _gpu_peak(module, calls[name], dtype)
        assert abs(estimate - measured) <= 0.15 * measured, (preset, side, name, estimate, measured)

"""The pipeline's memory methods on the tiny reference pipeline (CPU; GPU checks marked).

Each technique must give images equal to the plain run (atol 1e-5), twice in a row, leave the weights where
it says between calls, and `reset_device_map()` must leave plain modules (no hooks) that still give the
same images.
"""

import os

import pytest
import torch

from hooks import OffloadConflictError, group_offloading_session
from hooks.errors import OffloadConflictError
from hooks.hook_utils import hooks_of
from pipelines import TextToImagePipeline
from pipelines.errors import CallError
from same_output import assert_same_output

CALL = dict(num_inference_steps=1, output_type="pt")


@pytest.fixture(scope="module")
def reference():
    pipe = TextToImagePipeline.from_preset("tiny-unet")
    return generate(pipe)


@pytest.fixture
def pipe():
    return TextToImagePipeline.from_preset("tiny-unet")


def generate(pipe, prompt="a red square", side=32):
    with torch.no_grad():
        return pipe(prompt, generator=torch.Generator().manual_seed(0), height=side, width=side, **CALL).images


def tensor_devices(pipe):
    return {t.device.type for m in pipe.module_components.values() for t in [*m.parameters(), *m.buffers()]}


def hooked(pipe):
    return [f"{name}.{sub_name}" for name, module in pipe.module_components.items()
            for sub_name, sub in module.named_modules() if hasattr(sub, "_hf_hook")]


def between_calls_model(pipe, tmp_path):
    assert tensor_devices(pipe) == {"cpu"}


def between_calls_sequential(pipe, tmp_path):
    assert {p.device.type for m in pipe.module_components.values() for p in m.parameters()} == {"meta"}


def between_calls_group_ram(pipe, tmp_path):
    assert tensor_devices(pipe) == {"cpu"}
    assert all(group_offloading_session(m).resident_groups == [] for m in pipe.module_components.values())


def between_calls_group_disk(pipe, tmp_path):
    assert tensor_devices(pipe) == {"meta"}  # the bytes are only in the files now
    assert sorted(os.listdir(tmp_path)) == ["denoiser", "text_encoder", "vae"]


TECHNIQUES = {
    "model": (lambda pipe, tmp: pipe.enable_model_cpu_offload(), between_calls_model),
    "sequential": (lambda pipe, tmp: pipe.enable_sequential_cpu_offload(), between_calls_sequential),
    "group-block": (lambda pipe, tmp: pipe.enable_group_offload("cpu"), between_calls_group_ram),
    "group-leaf": (lambda pipe, tmp: pipe.enable_group_offload("cpu", offload_type="leaf_level"),
                   between_calls_group_ram),
    "group-disk": (lambda pipe, tmp: pipe.enable_group_offload(None, num_blocks_per_group=2,
                                                               offload_to_disk_path=tmp), between_calls_group_disk),
}


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_technique_equals_plain_run_twice_and_reset_restores(technique, pipe, reference, tmp_path):
    enable, check_between_calls = TECHNIQUES[technique]
    enable(pipe, tmp_path)
    for _ in range(2):
        assert_same_output(generate(pipe), reference)
        check_between_calls(pipe, tmp_path)  # the call itself ends with maybe_free_model_hooks()
    pipe.reset_device_map()
    assert hooked(pipe) == [] and tensor_devices(pipe) == {"cpu"}
    assert_same_output(generate(pipe), reference)


THEN = {  # what runs on top of layerwise casting (applied first, as docs/memory.md says)
    "nothing": lambda pipe: None,
    "group-leaf": lambda pipe: pipe.enable_group_offload("cpu", offload_type="leaf_level"),
    "model": lambda pipe: pipe.enable_model_cpu_offload(),
}


@pytest.mark.parametrize("then", THEN)
@pytest.mark.parametrize("storage_dtype, bound", [(torch.float8_e4m3fn, 0.05), (torch.bfloat16, 0.005)])
def test_layerwise_casting_alone_and_under_offloading(storage_dtype, bound, then, pipe, reference):
    """fp8 keeps 3 mantissa bits (<= 2**-4 relative per weight), bf16 8 (<= 2**-9): the images may differ from
    the full-precision ones by that much (measured 0.9% and 0.06%), and not at all between calls."""
    from hooks import apply_layerwise_casting

    apply_layerwise_casting(pipe.denoiser, storage_dtype=storage_dtype, compute_dtype=torch.float32)
    THEN[then](pipe)
    first, second = generate(pipe), generate(pipe)
    assert_same_output(second, first)
    assert 0 < ((first - reference).norm() / reference.norm()).item() < bound
    assert storage_dtype in {p.dtype for p in pipe.denoiser.parameters()}  # stored small between calls
    pipe.reset_device_map()
    assert hooked(pipe) == [] and {p.dtype for p in pipe.denoiser.parameters()} == {torch.float32}


@pytest.mark.parametrize("technique", [*TECHNIQUES, "layerwise-fp8"])
def test_accelerate_hook_removal_undoes_every_technique(technique, pipe, tmp_path):
    """Every technique is accelerate hooks: `remove_hook_from_module(recurse=True)` on each component leaves
    plain modules, weights on the CPU in their own dtype, nothing on disk, and the images of the technique."""
    from accelerate.hooks import remove_hook_from_module

    from hooks import apply_layerwise_casting

    if technique == "layerwise-fp8":
        apply_layerwise_casting(pipe.denoiser, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    else:
        TECHNIQUES[technique][0](pipe, tmp_path)
    expected = generate(pipe)
    for module in pipe.module_components.values():
        remove_hook_from_module(module, recurse=True)
    assert hooked(pipe) == [] and tensor_devices(pipe) == {"cpu"}
    assert {p.dtype for m in pipe.module_components.values() for p in m.parameters()} == {torch.float32}
    assert [name for _, _, names in os.walk(tmp_path) for name in names] == []  # group files removed
    assert_same_output(generate(pipe), expected)


def test_group_offload_with_no_arguments_just_works(pipe, reference):
    pipe.enable_group_offload()  # onload on GPU 0, or on the CPU without one; block level, one block a group
    assert_same_output(generate(pipe), reference)
    assert all(group_offloading_session(m).resident_groups == [] for m in pipe.module_components.values())


def test_model_offload_twice_follows_the_model_graph(pipe, reference):
    pipe.enable_model_cpu_offload()
    pipe.enable_model_cpu_offload()
    chain = pipe._model_offload
    assert [hook.model for hook in chain.chained] == [pipe.text_encoder, pipe.denoiser, pipe.vae]
    assert all(len(hooks_of(m)) == 1 for m in pipe.module_components.values())
    assert_same_output(generate(pipe), reference)
    assert pipe.component_execution_device("denoiser") == chain.execution_device


def test_offload_methods_refuse_a_device_mapped_pipeline(pipe):
    pipe.hf_device_map = {"text_encoder": 0, "denoiser": 0, "vae": 0}
    for method in (pipe.enable_model_cpu_offload, pipe.enable_sequential_cpu_offload, pipe.enable_group_offload):
        with pytest.raises(OffloadConflictError, match=r"reset_device_map\(\) first"):
            method()
    assert hooked(pipe) == []


def test_switching_techniques_needs_a_reset_and_failures_leave_nothing_behind(pipe, reference):
    pipe.enable_model_cpu_offload()
    with pytest.raises(OffloadConflictError):
        pipe.enable_group_offload("cpu")
    with pytest.raises(OffloadConflictError):
        pipe.enable_sequential_cpu_offload()
    pipe.reset_device_map()

    # The vae already carries group offloading: sequential offload fails on it, and the components it had
    # already offloaded (text encoder, denoiser) are restored.
    from hooks import GroupOffloadingConfig, apply_group_offloading

    apply_group_offloading(pipe.vae, GroupOffloadingConfig(onload_device="cpu"))
    with pytest.raises(OffloadConflictError, match="already has group offloading"):
        pipe.enable_sequential_cpu_offload()
    assert [name for name in hooked(pipe) if not name.startswith("vae")] == []
    assert {p.device.type for p in pipe.denoiser.parameters()} == {"cpu"}
    pipe.reset_device_map()
    pipe.enable_group_offload("cpu", offload_type="leaf_level")
    assert_same_output(generate(pipe), reference)


def _decoder_batches(pipe) -> list[int]:
    """The batch size of every call of the VAE's decoder network (one per sample slice and per tile)."""
    batches: list[int] = []
    pipe.vae.decoder.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
    return batches


def test_vae_slicing_decodes_sample_by_sample_and_saves_nothing_for_one(pipe):
    prompts = ["a red square", "a blue circle"]
    batches = _decoder_batches(pipe)
    batch = generate(pipe, prompts)
    pipe.enable_vae_slicing()
    assert pipe.vae.use_slicing
    sliced = generate(pipe, prompts)
    assert_same_output(sliced, batch)  # one sample at a time, same images
    generate(pipe)  # a batch of one: one decode, exactly as without slicing
    assert batches == [2, 1, 1, 1]
    pipe.disable_vae_slicing()
    assert not pipe.vae.use_slicing

    pipe.register_components(vae=None)
    with pytest.raises(CallError, match="no vae"):
        pipe.enable_vae_slicing()


def test_vae_tiling_splits_images_larger_than_a_tile_and_skips_the_others(pipe):
    """tile_sample_size=32 pixels on the tiny VAE (factor 2): 16-latent tiles overlapping by 4."""
    from pipelines.text_to_image.models.autoencoder_kl import TileGrid

    plain = {side: generate(pipe, side=side) for side in (32, 48)}
    batches = _decoder_batches(pipe)
    pipe.enable_vae_tiling(tile_sample_size=32)
    assert pipe.vae.use_tiling and pipe.vae.tile_sample_size == 32
    # Exact: one tile is not tiled, so the same module runs the same ops on the same tensors as the plain call.
    torch.testing.assert_close(generate(pipe, side=32), plain[32], atol=0, rtol=0)
    assert len(batches) == 1
    tiled = generate(pipe, side=48)
    assert len(batches) == 1 + len(TileGrid.cover(24, 16, 4).starts) ** 2
    difference = ((tiled - plain[48]).norm() / plain[48].norm()).item()
    assert 0 < difference < 0.1, difference  # close to, not equal to, the untiled decode
    pipe.disable_vae_tiling()
    assert not pipe.vae.use_tiling
    torch.testing.assert_close(generate(pipe, side=48), plain[48], atol=0, rtol=0)  # tiling off: the plain path


@pytest.mark.filterwarnings("ignore:No accelerator to plan for")
@pytest.mark.parametrize("technique", [*TECHNIQUES, "device-map"])
def test_vae_slicing_and_tiling_work_under_every_technique(technique, tmp_path):
    prompts = ["a red square", "a blue circle"]

    def sliced_and_tiled(pipe):
        pipe.enable_vae_slicing()
        pipe.enable_vae_tiling(tile_sample_size=32)
        return generate(pipe, prompts, side=48)  # 2 samples x 2 x 2 overlapping tiles of 32 pixels

    plain = TextToImagePipeline.from_preset("tiny-unet")
    expected = sliced_and_tiled(plain)
    if technique == "device-map":
        plain.save_pretrained(tmp_path / "folder")
        pipe = TextToImagePipeline.from_pretrained(tmp_path / "folder", device_map="balanced", progress=False)
        assert pipe.hf_device_map is not None
    else:
        pipe = TextToImagePipeline.from_preset("tiny-unet")
        TECHNIQUES[technique][0](pipe, tmp_path / "groups")
    assert_same_output(sliced_and_tiled(pipe), expected)


# --- GPU: peak memory ordering, on the tiny pipelines and on a mid-size one where weights dominate --------

MID_SIZE = 128  # pixels: 64 x 64 latents (tiny VAE), 1024 image tokens for the DiT


def mid_size_pipeline(device: str = "cpu") -> TextToImagePipeline:
    """tiny-dit's layout with a mid-size DiT (width 1024, 4 double + 8 single blocks: ~270M parameters, ~1.1 GB
    in fp32) and 512-wide text encoders (~13M each): the denoiser's weights are ~7x its largest block,
    and far above every activation peak at MID_SIZE, so the techniques' weight savings decide the order."""
    from pipelines.text_to_image.models import AutoencoderKL, DiT, TextEncoder
    from pipelines.text_to_image.presets import build_preset_components

    def resized(config, **update):
        return type(config)(**{**config.model_dump(), **update})

    encoder = dict(hidden_size=512, num_layers=4, num_heads=8, intermediate_size=2048)
    components = build_preset_components("tiny-dit", device=device)
    with torch.random.fork_rng(devices=[]), (torch.device("meta") if device == "meta" else torch.device("cpu")):
        torch.manual_seed(0)
        components.update(
            text_encoder=TextEncoder(resized(TextEncoder.presets["tiny"], projection_dim=512, **encoder)).eval(),
            text_encoder_2=TextEncoder(resized(TextEncoder.presets["tiny-t5"], **encoder)).eval(),
            denoiser=DiT(resized(DiT.presets["tiny"], hidden_size=1024, num_heads=16, num_double_layers=4,
                                 num_single_layers=8, joint_attention_dim=512, pooled_projection_dim=512)).eval(),
            vae=AutoencoderKL(AutoencoderKL.presets["tiny"]).eval(),
        )
    return TextToImagePipeline(**components)


def test_mid_size_pipeline_is_dominated_by_the_denoisers_weights():
    """The premise of the mid-size GPU ordering test, checked on every machine (meta: no memory)."""
    pipe = mid_size_pipeline(device="meta")
    weights = {name: sum(p.numel() * p.element_size() for p in m.parameters())
               for name, m in pipe.module_components.items()}
    denoiser = pipe.denoiser
    largest_block = max(sum(p.numel() * p.element_size() for p in block.parameters())
                        for block in [*denoiser.double_blocks, *denoiser.single_blocks])
    assert weights["denoiser"] > 6 * largest_block  # block-level offload keeps far less than model offload
    assert weights["denoiser"] > 8 * max(w for name, w in weights.items() if name != "denoiser")
    calls = pipe.activation_inputs(MID_SIZE, MID_SIZE)
    peak_activations = max(call.estimate(pipe.module_components[name]) for name, call in calls.items())
    assert peak_activations < largest_block  # the weights each technique keeps resident decide the peak


def _peak_and_images(pipe, side: int) -> tuple[int, torch.Tensor]:
    """torch.cuda.max_memory_allocated over one call, and the call's images (on the CPU)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        images = pipe("a red square", generator=torch.Generator().manual_seed(0), num_inference_steps=2,
                      height=side, width=side, output_type="pt").images
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), images.cpu()


def _peaks_per_technique(build, side: int) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    peaks, images = {}, {}
    for technique in ("none", "model", "group-block", "group-leaf-stream"):
        pipe = build()
        if technique == "none":
            pipe.to("cuda")
        elif technique == "model":
            pipe.enable_model_cpu_offload()
        elif technique == "group-block":
            pipe.enable_group_offload(0)
        else:
            pipe.enable_group_offload(0, offload_type="leaf_level", use_stream=True)
        _peak_and_images(pipe, side)  # first call: traces the prefetch order; it ends with everything offloaded
        peaks[technique], images[technique] = _peak_and_images(pipe, side)
        pipe.reset_device_map()
        del pipe
        torch.cuda.empty_cache()
    return peaks, images


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-unet", "tiny-dit"])
def test_peak_memory_ordering_on_gpu(preset):
    """no offload > model offload >= group(block) >= group(leaf, stream), measured over a whole call.

    `>=`, not `>`: the tiny models' weights are a few hundred KiB, less than the activations of the VAE's
    decode at 64x64, which set the peak under every offloading technique alike (the mid-size test below has
    weights dominate and the strict order).
    """
    peaks, images = _peaks_per_technique(lambda: TextToImagePipeline.from_preset(preset), 64)
    assert peaks["group-leaf-stream"] <= peaks["group-block"] <= peaks["model"] < peaks["none"], peaks
    for technique, image in images.items():
        torch.testing.assert_close(image, images["none"], atol=1e-4, rtol=0, msg=technique)


@pytest.mark.gpu
def test_peak_memory_ordering_on_gpu_for_a_mid_size_pipeline():
    """group(leaf, stream) <= group(block) < model offload < no offload when weights dominate: the issue's
    order, strict where the technique keeps fewer weights resident; every technique gives the same images."""
    peaks, images = _peaks_per_technique(mid_size_pipeline, MID_SIZE)
    assert peaks["group-leaf-stream"] <= peaks["group-block"] < peaks["model"] < peaks["none"], peaks
    # Model offload keeps the whole denoiser; block-level group offload its rest and one block at a time.
    denoiser_bytes = sum(p.numel() * p.element_size() for p in mid_size_pipeline(device="meta").denoiser.parameters())
    assert peaks["model"] - peaks["group-block"] > denoiser_bytes // 2, peaks
    for technique, image in images.items():
        # Convolutions may use TF32 on the GPU; the techniques change where weights live, not the math.
        torch.testing.assert_close(image, images["none"], atol=1e-3, rtol=0, msg=technique)

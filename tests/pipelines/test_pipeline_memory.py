"""The pipeline's memory methods on the tiny reference pipeline (CPU; GPU checks marked).

Each technique must give images equal to the plain run (atol 1e-5), twice in a row, leave the weights where
it says between calls, and `reset_device_map()` must leave plain modules (no hooks) that still give the
same images.
"""

import os

import pytest
import torch

from hooks import OffloadConflictError, group_offloading_session
from hooks.hook_utils import hooks_of
from pipelines import TextToImagePipeline
from pipelines.errors import DeviceMappedError
from pipelines.pipeline_memory import VaeFeatureError

CALL = dict(num_inference_steps=1, height=32, width=32, output_type="pt")


@pytest.fixture(scope="module")
def reference():
    pipe = TextToImagePipeline.from_preset("tiny-unet")
    return generate(pipe)


@pytest.fixture
def pipe():
    return TextToImagePipeline.from_preset("tiny-unet")


def generate(pipe, prompt="a red square"):
    with torch.no_grad():
        return pipe(prompt, generator=torch.Generator().manual_seed(0), **CALL).images


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
        torch.testing.assert_close(generate(pipe), reference, atol=1e-5, rtol=0)
        pipe.maybe_free_model_hooks()
        check_between_calls(pipe, tmp_path)
    pipe.reset_device_map()
    assert hooked(pipe) == [] and tensor_devices(pipe) == {"cpu"}
    torch.testing.assert_close(generate(pipe), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("storage_dtype, bound", [(torch.float8_e4m3fn, 0.05), (torch.bfloat16, 0.005)])
def test_layerwise_casting_then_group_offload_on_the_denoiser(storage_dtype, bound, pipe, reference):
    """fp8 keeps 3 mantissa bits (<= 2**-4 relative per weight), bf16 8 (<= 2**-9): the images may differ from
    the full-precision ones by that much (measured 0.9% and 0.06%), and not at all between calls."""
    from hooks import apply_layerwise_casting

    apply_layerwise_casting(pipe.denoiser, storage_dtype=storage_dtype, compute_dtype=torch.float32)
    pipe.enable_group_offload("cpu", offload_type="leaf_level")
    first, second = generate(pipe), generate(pipe)
    torch.testing.assert_close(second, first, atol=1e-5, rtol=0)
    assert 0 < ((first - reference).norm() / reference.norm()).item() < bound
    assert storage_dtype in {p.dtype for p in pipe.denoiser.parameters()}  # stored small between calls
    pipe.reset_device_map()
    assert hooked(pipe) == [] and {p.dtype for p in pipe.denoiser.parameters()} == {torch.float32}


def test_model_offload_twice_follows_the_model_graph(pipe, reference):
    pipe.enable_model_cpu_offload()
    pipe.enable_model_cpu_offload()
    chain = pipe._model_offload
    assert [hook.model for hook in chain.chained] == [pipe.text_encoder, pipe.denoiser, pipe.vae]
    assert all(len(hooks_of(m)) == 1 for m in pipe.module_components.values())
    torch.testing.assert_close(generate(pipe), reference, atol=1e-5, rtol=0)
    assert pipe.component_execution_device("denoiser") == chain.execution_device


def test_offload_methods_refuse_a_device_mapped_pipeline(pipe):
    pipe.hf_device_map = {"text_encoder": 0, "denoiser": 0, "vae": 0}
    for method in (pipe.enable_model_cpu_offload, pipe.enable_sequential_cpu_offload, pipe.enable_group_offload):
        with pytest.raises(DeviceMappedError, match=r"reset_device_map\(\) first"):
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
    with pytest.raises(OffloadConflictError, match="group-offloaded"):
        pipe.enable_sequential_cpu_offload()
    assert [name for name in hooked(pipe) if not name.startswith("vae")] == []
    assert {p.device.type for p in pipe.denoiser.parameters()} == {"cpu"}
    pipe.reset_device_map()
    pipe.enable_group_offload("cpu", offload_type="leaf_level")
    torch.testing.assert_close(generate(pipe), reference, atol=1e-5, rtol=0)


def test_vae_slicing_and_tiling_are_wired_to_the_vae(pipe):
    prompts = ["a red square", "a blue circle"]
    with torch.no_grad():
        batch = pipe(prompts, generator=torch.Generator().manual_seed(0), **CALL).images
        pipe.enable_vae_slicing()
        assert pipe.vae.use_slicing
        sliced = pipe(prompts, generator=torch.Generator().manual_seed(0), **CALL).images
        pipe.disable_vae_slicing()
        assert not pipe.vae.use_slicing
    torch.testing.assert_close(sliced, batch, atol=1e-5, rtol=0)  # one sample at a time, same images

    pipe.enable_vae_tiling()
    assert pipe.vae.use_tiling
    pipe.disable_vae_tiling()
    assert not pipe.vae.use_tiling

    pipe.register_components(vae=None)
    with pytest.raises(VaeFeatureError, match="no vae"):
        pipe.enable_vae_slicing()


def _peak_bytes(pipe) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        pipe("a red square", generator=torch.Generator().manual_seed(0), num_inference_steps=2, height=64,
             width=64, output_type="pt")
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-unet", "tiny-dit"])
def test_peak_memory_ordering_on_gpu(preset):
    """no offload > model offload >= group(block) >= group(leaf, stream), measured over a whole call.

    `>=` where the VAE decode sets the peak: AutoencoderKL has no top-level block list, so block-level
    group offload keeps all of it resident while it decodes, exactly as model offload does.
    """
    peaks = {}
    for technique in ("none", "model", "group-block", "group-leaf-stream"):
        pipe = TextToImagePipeline.from_preset(preset)
        if technique == "none":
            pipe.to("cuda")
        elif technique == "model":
            pipe.enable_model_cpu_offload()
        elif technique == "group-block":
            pipe.enable_group_offload(0)
        else:
            pipe.enable_group_offload(0, offload_type="leaf_level", use_stream=True)
        _peak_bytes(pipe)  # first call: traces the prefetch order
        pipe.maybe_free_model_hooks()
        peaks[technique] = _peak_bytes(pipe)
        pipe.reset_device_map()
        del pipe
        torch.cuda.empty_cache()
    assert peaks["group-leaf-stream"] <= peaks["group-block"] <= peaks["model"] < peaks["none"], peaks

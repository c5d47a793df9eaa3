"""diffusers' spellings work beside ours: `dtype=`, the Hub download keywords, `use_safetensors`,
`apply_group_offloading`'s keywords, `enable_group_offload` / `enable_layerwise_casting` on a user's models,
`set_progress_bar_config` and the step bar, and the load bar in bytes labelled by component."""

from __future__ import annotations

import io

import pytest
import torch

import pipelines
import pipelines.checkpoint.streaming as progress_module
import pipelines.folder.sources as hub
from hooks.group_offload import GroupOffloadingConfig, apply_group_offloading, remove_group_offloading
from hooks import OffloadConfigError
from pipelines import Pipeline
from pipelines.errors import LoadError

from pipeline_fixtures import Decoder, Denoiser, save_preset
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("spellings") / "tiny-flux")[0]


def test_dtype_is_torch_dtype(folder):
    pipe = Pipeline.from_pretrained(folder, dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in pipe.transformer.parameters()} == {torch.bfloat16}
    plan = Pipeline.plan_placement(folder, dtype=torch.float16, max_memory={0: "1GiB"})
    assert all(c.dtype.startswith("float16 (torch_dtype") for c in plan.components.values())  # T5 keeps wo in fp32
    same = Pipeline.plan_placement(folder, dtype=torch.float16, torch_dtype=torch.float16, max_memory={0: "1GiB"})
    assert same.components == plan.components
    with pytest.raises(LoadError, match="torch_dtype=torch.float32 and dtype=torch.float16"):
        Pipeline.from_pretrained(folder, torch_dtype=torch.float32, dtype=torch.float16)


def test_model_entry_takes_dtype(folder):
    model = pipelines.load_model(folder / "text_encoder_2", dtype=torch.float16, progress=False)
    assert model.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float16
    plan = pipelines.plan_model(folder / "text_encoder_2", dtype=torch.float16, max_memory={0: "1GiB"})
    same = pipelines.plan_model(folder / "text_encoder_2", torch_dtype=torch.float16, max_memory={0: "1GiB"})
    assert plan.components == same.components  # (the rest holds what this machine measured, e.g. its disk's speed)
    with pytest.raises(LoadError, match="torch_dtype=torch.float32 and dtype=torch.float16"):
        pipelines.load_model(folder / "text_encoder_2", torch_dtype=torch.float32, dtype=torch.float16)


def test_model_dtype_and_use_safetensors(folder):
    model = pipelines.load_model(folder / "text_encoder_2", torch_dtype=torch.float16, use_safetensors=True,
                                 progress=False)
    block = model.encoder.block[0]
    assert block.layer[0].SelfAttention.q.weight.dtype == torch.float16
    assert block.layer[1].DenseReluDense.wo.weight.dtype == torch.float32  # T5's _keep_in_fp32_modules honoured
    with pytest.raises(LoadError, match="never unpickles"):
        pipelines.load_model(folder / "text_encoder_2", use_safetensors=False)


def test_hub_keywords_reach_snapshot_download(folder, tmp_path, monkeypatch):
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(folder)

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", snapshot_download)
    options = dict(revision="v1", token="hf_x", cache_dir=str(tmp_path / "cache"), local_files_only=True)
    Pipeline.from_pretrained("org/tiny", progress=False, variant=None, **options)
    Pipeline.plan_placement("org/tiny", max_memory={0: "1GiB"}, **options)
    for repo_id, kwargs in calls:
        assert repo_id == "org/tiny" and {key: kwargs[key] for key in options} == options
    assert len(calls) == 2
    calls.clear()
    Pipeline.plan_placement("org/tiny", max_memory={0: "1GiB"})  # the options do not leak
    assert calls[0][1].get("token") is None and "local_files_only" not in calls[0][1]


def test_model_hub_keywords(folder, tmp_path, monkeypatch):
    seen = {}

    def snapshot_download(repo_id, **kwargs):
        seen.update(kwargs)
        return str(folder)

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", snapshot_download)
    pipelines.load_model("org/tiny", subfolder="transformer", revision="main", token=False, cache_dir=str(tmp_path),
                         local_files_only=True, progress=False)
    assert seen["revision"] == "main" and seen["cache_dir"] == str(tmp_path) and seen["local_files_only"] is True


def user_denoiser():
    """A user's diffusers model with a ModuleList of blocks, and inputs for it."""
    torch.manual_seed(0)
    model = Denoiser(depth=4).eval()
    return model, (torch.randn(2, model.config.width), torch.randn(2, model.config.width))


def test_apply_group_offloading_takes_diffusers_keywords():
    model, inputs = user_denoiser()
    expected = model(*inputs)
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=2, non_blocking=True, record_stream=False, low_cpu_mem_usage=True)
    assert_same_output(model(*inputs), expected)
    remove_group_offloading(model)
    apply_group_offloading(model, torch.device("cpu"), offload_type="leaf_level")  # onload_device by position
    assert_same_output(model(*inputs), expected)
    remove_group_offloading(model)
    with pytest.raises(OffloadConfigError, match="block_modules"):
        apply_group_offloading(model, onload_device="cpu", block_modules=["blocks"])
    with pytest.raises(OffloadConfigError, match="not both"):
        apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"), num_blocks_per_group=2)
    with pytest.raises(OffloadConfigError, match="unknown keywords \\['num_block_per_group'\\]"):
        apply_group_offloading(model, onload_device="cpu", num_block_per_group=2)


def test_models_have_enable_group_offload_and_enable_layerwise_casting():
    model, inputs = user_denoiser()
    expected = model(*inputs)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    assert_same_output(model(*inputs), expected)
    remove_group_offloading(model)
    torch.manual_seed(0)
    plain = Decoder().eval()
    x = torch.randn(2, plain.config.width)
    expected = plain(x)
    plain.enable_layerwise_casting(storage_dtype=torch.bfloat16)  # compute dtype: the model's own (float32)
    assert plain.proj.weight.dtype == torch.bfloat16
    out = plain(x)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=0.05)


def test_set_progress_bar_config_and_the_step_bar(folder):
    pipe = Pipeline.from_pretrained(folder, progress=False)
    sink = io.StringIO()
    pipe.set_progress_bar_config(disable=False, file=sink, desc="Sampling")
    pipe("a cat", height=16, width=16, num_inference_steps=3, output_type="np")
    assert "Sampling" in sink.getvalue() and "3/3" in sink.getvalue()
    pipe.set_progress_bar_config(disable=True, file=sink)
    before = sink.getvalue()
    pipe("a cat", height=16, width=16, num_inference_steps=2, output_type="np")
    assert sink.getvalue() == before


def load_bars(folder, monkeypatch):
    """The bars a bf16 load of `folder` onto the CPU shows, each with every label it had, and the pipeline."""
    bars = []

    class RecordingBar(progress_module.tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.update(disable=False, file=io.StringIO())
            super().__init__(*args, **kwargs)
            self.labels = [self.desc]
            bars.append(self)

        def set_description(self, desc=None, refresh=True):
            self.labels.append(desc)
            super().set_description(desc, refresh)

    monkeypatch.setattr(progress_module, "tqdm", RecordingBar)
    pipe = Pipeline.from_pretrained(folder, device_map="cpu", dtype=torch.bfloat16)
    return bars, pipe


def test_load_progress_is_one_bar_in_bytes_labelled_by_component(folder, monkeypatch):
    (bar,), pipe = load_bars(folder, monkeypatch)
    assert bar.unit == "B" and bar.total == sum(c.bytes for c in pipe.placement_plan.components.values())
    assert [label for label in bar.labels[1:]] == [f"Loading {name}" for name in pipe.placement_plan.components]


def test_the_load_bar_ends_full(folder, monkeypatch):
    (bar,), _ = load_bars(folder, monkeypatch)
    assert bar.n == bar.total

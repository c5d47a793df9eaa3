"""One meta builder (`build_component`) for our models, diffusers' and transformers'; one placer
(`place_component`) with one undo; each safetensors header read once per load; the accelerators not detected
per streamed tensor."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

import pipelines.checkpoint.index as checkpoint_index
import pipelines.checkpoint.streaming as streaming
import placement.devices as devices
from checkpoint_models import TinyModel, tiny_model
from own_fixtures import has_hooks, save_preset
from pipelines import TextToImagePipeline
from pipelines.folder.sources import Family
from pipelines.loading.meta import WeightsReader, build_component
from pipelines.loading.placing import place_component
from placement.devices import detect_accelerators


@pytest.fixture
def saved(tmp_path):
    tiny_model().save_pretrained(tmp_path / "m", max_shard_size=3000)
    return tmp_path / "m"


def test_a_model_built_on_meta_carries_its_load_facts(saved):
    meta = build_component("TinyModel", TinyModel, saved, family=Family.OWN, dtype=torch.float16, variant=None,
                           weights_required=True)
    assert meta.weights.is_sharded and meta.reader is WeightsReader.STREAM and meta.dtype_origin == "torch_dtype"
    assert meta.keep_in_fp32 == ("norm_out",) and meta.tied_weights == {"head.weight": "embed.weight"}
    assert {p.device.type for p in meta.module.parameters()} == {"meta"}  # init_empty_weights keeps buffers
    # Each tensor in the dtype it loads as: cast floats, kept fp32 modules, integer buffers as saved.
    assert meta.module.blocks[0].fc1.weight.dtype is torch.float16 and meta.load_dtypes["blocks.0.fc1.weight"] is torch.float16
    assert meta.module.norm_out.weight.dtype is torch.float32 and meta.load_dtypes["norm_out.weight"] is torch.float32
    assert meta.module.steps.dtype is torch.int64
    assert meta.module.head.weight is meta.module.embed.weight  # re-tied after the re-typing


def test_planning_without_weights_keeps_the_config_dtypes(saved, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "config.json").write_text((saved / "config.json").read_text())
    meta = build_component("TinyModel", TinyModel, configs, family=Family.OWN, dtype=None, variant=None,
                           weights_required=False)
    assert meta.weights is None and meta.load_dtypes == {} and meta.dtype_origin.startswith("config.json only")


def test_place_component_undoes_everything_when_the_runtime_fails(saved, monkeypatch):
    import pipelines.loading.placing as placing

    meta = build_component("TinyModel", TinyModel, saved, family=Family.OWN, dtype=None, variant=None,
                           weights_required=True)
    plan = TinyModel.plan_placement(saved, device_map={"": "cpu", "blocks.1": "disk"}, offload_folder=saved)
    monkeypatch.setattr(placing, "apply_component_plan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        place_component(meta, plan.components["TinyModel"], accelerators=detect_accelerators(), progress=False)
    assert has_hooks(meta.module) == [] and {t.device.type for t in meta.module.state_dict().values()} == {"meta"}


@pytest.fixture
def header_reads(monkeypatch):
    reads = collections.Counter()
    real = checkpoint_index.read_header

    def counting(path):
        reads[f"{Path(path).parent.name}/{Path(path).name}"] += 1
        return real(path)

    monkeypatch.setattr(checkpoint_index, "read_header", counting)
    return reads


def test_each_header_is_read_once_per_load(tmp_path, header_reads, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    folder, pipe = save_preset(tmp_path / "p")
    pipe.denoiser.save_pretrained(folder / "denoiser", max_shard_size=20_000)  # a sharded component too
    shards = len(list((folder / "denoiser").glob("*.safetensors")))
    assert shards > 1
    header_reads.clear()
    TextToImagePipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "1GiB", 1: "1GiB"},
                                        progress=False)
    assert len(header_reads) == 3 + shards and set(header_reads.values()) == {1}, header_reads
    header_reads.clear()
    TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"})
    assert len(header_reads) == 3 + shards and set(header_reads.values()) == {1}, header_reads
    header_reads.clear()
    TinyModel.from_pretrained(_saved_model(tmp_path), device_map="auto", max_memory={0: "1GiB"}, progress=False)
    assert set(header_reads.values()) == {1}, header_reads


def _saved_model(tmp_path) -> Path:
    tiny_model().save_pretrained(tmp_path / "m", max_shard_size=3000)
    return tmp_path / "m"


def test_accelerators_are_detected_per_load_not_per_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    folder, _ = save_preset(tmp_path / "p")
    # The streamer is given the load's Accelerators: it never detects them itself.
    monkeypatch.setattr(streaming, "detect_accelerators", lambda: pytest.fail("detected while streaming"))
    calls = []
    real = devices.detect_accelerators
    monkeypatch.setattr(devices, "detect_accelerators", lambda: calls.append(1) or real())
    pipe = TextToImagePipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "1GiB", 1: "1GiB"},
                                               progress=False)
    tensors = sum(len(module.state_dict()) for module in pipe.module_components.values())
    assert tensors > 100 and len(calls) < tensors // 10  # the planner's and the hooks' own, not one per tensor


diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def test_diffusers_and_transformers_models_are_built_by_the_same_builder(tmp_path):
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=2,
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",))
    vae.save_pretrained(tmp_path / "vae")
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                                           num_heads=2))
    t5.save_pretrained(tmp_path / "t5")
    built_vae = build_component("vae", diffusers.AutoencoderKL, tmp_path / "vae", family=Family.DIFFUSERS,
                                dtype=torch.bfloat16, variant=None, weights_required=True)
    built_t5 = build_component("text_encoder", transformers.T5EncoderModel, tmp_path / "t5",
                               family=Family.TRANSFORMERS, dtype=torch.float16, variant=None, weights_required=True)
    assert built_vae.module.encoder.conv_in.weight.dtype is torch.bfloat16
    # T5 stores the shared embedding once: the encoder's copy is a tie the builder found itself.
    assert built_t5.tied_weights == {"encoder.embed_tokens.weight": "shared.weight"}
    assert "wo" in built_t5.keep_in_fp32 and built_t5.load_dtypes["shared.weight"] is torch.float16
    for meta in (built_vae, built_t5):
        place_component(meta, None, accelerators=detect_accelerators(), progress=False)
        assert {t.device.type for t in meta.module.state_dict().values()} == {"cpu"}
    assert torch.equal(built_t5.module.shared.weight, t5.shared.weight.to(torch.float16))

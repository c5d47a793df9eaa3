"""An absurd config is refused before work, with the number and the limit: block counts above the limit before
the constructor runs, tensors beyond every budget before torch allocates them, a call larger than any device
before its activations are estimated, JSON nested without end before anything walks it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pipelines
from pipelines import Pipeline
from pipelines.errors import FolderError
from pipelines.loading import limits as build_limits
from diffusers.models.transformers import transformer_flux
from placement.errors import DoesNotFitError

from pipeline_fixtures import save_preset

BUDGETS = {0: "24GiB", "cpu": "64GiB"}
HUGE = 10**12


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    return save_preset(tmp_path_factory.mktemp("limits") / "tiny-flux")[0]


def configs_only(tiny_flux, tmp_path, component="transformer", **changes):
    """A copy of tiny-flux without weights, `changes` written into `component`'s config.json."""
    folder = tmp_path / "pipe"
    shutil.copytree(tiny_flux, folder)
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    path = folder / component / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


@pytest.fixture
def constructions(monkeypatch):
    """How many FLUX single-stream blocks constructors started (the heavy step an absurd block count must never reach)."""
    counts = {"blocks": 0}
    original = transformer_flux.FluxSingleTransformerBlock.__init__

    def counting(self, *args, **kwargs):
        counts["blocks"] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(transformer_flux.FluxSingleTransformerBlock, "__init__", counting)
    return counts


@pytest.fixture
def asked(monkeypatch):
    """Every size torch.empty was asked for below the limits' own check (what reached the allocator)."""
    sizes = []
    original = torch.empty

    def recording(*args, **kwargs):
        sizes.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording)
    return sizes


def test_a_block_count_past_the_limit_is_refused_before_any_block_is_built(tiny_flux, tmp_path, constructions):
    folder = configs_only(tiny_flux, tmp_path, num_single_layers=HUGE)
    with pytest.raises(FolderError, match=rf"'transformer'.*num_single_layers={HUGE}.*the limit is 10000"):
        Pipeline.plan_placement(folder, max_memory=BUDGETS)
    assert constructions["blocks"] == 0


def test_a_width_beyond_every_budget_is_refused_before_torch_allocates_it(tiny_flux, tmp_path, asked):
    folder = configs_only(tiny_flux, tmp_path, attention_head_dim=HUGE, num_attention_heads=1)
    with pytest.raises(DoesNotFitError, match=rf"'transformer'.*attention_head_dim={HUGE}.*TiB.*GPU 0 24.00 GiB \+ CPU "
                                              r"64.00 GiB \+ disk"):
        Pipeline.plan_placement(folder, max_memory=BUDGETS)
    assert not [size for size in asked if HUGE in (size[0] if isinstance(size[0], tuple) else size)]


def test_blocks_that_together_exceed_every_budget_are_refused_naming_their_count(tiny_flux, tmp_path, constructions):
    folder = configs_only(tiny_flux, tmp_path, num_single_layers=5000)
    with pytest.raises(DoesNotFitError, match=r"so far \(blocks repeated as .*num_single_layers=5000.*"
                                              r"disk 1.00 MiB"):
        Pipeline.plan_placement(folder, max_memory={"cpu": "1MiB", "disk": "1MiB"}, offload_folder=tmp_path / "o")
    assert 0 < constructions["blocks"] < 5000


def test_a_model_within_the_budgets_is_planned_as_before(tiny_flux):
    plan = Pipeline.plan_placement(tiny_flux, max_memory=BUDGETS)
    assert plan.verdict.kind.value == "fits on accelerators"


def test_the_limit_counts_every_budget_and_the_disk():
    limit = build_limits.BuildLimit.of({0: "1GiB", 1: "1GiB", "cpu": "2GiB", "disk": "4GiB"}, None, accelerators=0)
    assert limit.total == 8 * 1024**3
    assert limit.described == "GPU 0 1.00 GiB + GPU 1 1.00 GiB + CPU 2.00 GiB + disk 4.00 GiB = 8.00 GiB"
    detected = build_limits.BuildLimit.of(None, None, accelerators=2)  # touches no device: a bound per accelerator
    assert detected.described.startswith("2 accelerator(s) (1 TiB each at most) 2.00 TiB + RAM ")
    assert detected.total > 2 * 1024**4


def test_the_fewest_bits_follow_the_format():
    assert build_limits.fewest_bits(None, quantized=False, layerwise=False) == 8
    assert build_limits.fewest_bits(torch.bfloat16, quantized=False, layerwise=False) == 16
    assert build_limits.fewest_bits(torch.bfloat16, quantized=False, layerwise=True) == 8
    assert build_limits.fewest_bits(torch.bfloat16, quantized=True, layerwise=False) == 1


def test_factory_shapes_are_read_as_torch_reads_them():
    assert build_limits._shape((2, 3), {}) == (2, 3)
    assert build_limits._shape(((2, 3),), {}) == (2, 3)
    assert build_limits._shape((), {"size": (4,)}) == (4,)
    assert build_limits._full_shape(((2, 5), 0.5), {}) == (2, 5)
    assert build_limits._arange_shape((10,), {}) == (10,)
    assert build_limits._arange_shape((2, 10, 3), {}) == (3,)
    assert build_limits._arange_shape((0,), {"end": 7}) == (7,)


def test_transformers_and_diffusers_configs_are_held_to_the_same_limits(tmp_path):
    transformers = pytest.importorskip("transformers")
    diffusers = pytest.importorskip("diffusers")
    t5 = transformers.T5Config(vocab_size=64, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4)
    transformers.T5EncoderModel(t5).save_pretrained(tmp_path / "t5")
    diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4).save_pretrained(
        tmp_path / "vae")
    for folder, changes, error, words in [
        (tmp_path / "t5", {"num_layers": HUGE}, FolderError, f"num_layers={HUGE}"),
        (tmp_path / "t5", {"d_model": HUGE}, DoesNotFitError, f"d_model={HUGE}"),
        (tmp_path / "vae", {"layers_per_block": HUGE}, FolderError, f"layers_per_block={HUGE}"),
        (tmp_path / "vae", {"block_out_channels": [HUGE]}, DoesNotFitError, "TiB"),
    ]:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(error, match=words):
            pipelines.plan_model(folder, max_memory=BUDGETS)
        (folder / "config.json").write_text(json.dumps(config))


def test_a_call_larger_than_any_device_is_refused_before_its_activations_are_estimated(tiny_flux, tmp_path,
                                                                                         monkeypatch):
    pytest.importorskip("diffusers")
    from family_folders import write_configs_folder

    wan = write_configs_folder(tmp_path / "wan", "wan2.1-t2v-1.3b")
    estimated = []
    monkeypatch.setattr("pipelines.loading.planning._planned_call", lambda *a, **k: estimated.append(1))
    with pytest.raises(DoesNotFitError, match=r"5.46 TiB .*height=1000000, width=1000000.*largest budget "
                                              r"\(CPU: 64.00 GiB\)"):
        Pipeline.plan_placement(tiny_flux, max_memory=BUDGETS, call={"height": 10**6, "width": 10**6})
    with pytest.raises(DoesNotFitError, match=rf"token ids \(max_sequence_length={HUGE}"):
        Pipeline.plan_placement(wan, max_memory=BUDGETS, call={"max_sequence_length": HUGE})
    with pytest.raises(DoesNotFitError, match=r"decoded output \(height=480, width=832, num_frames=100000000"):
        Pipeline.plan_placement(wan, max_memory=BUDGETS, call={"height": 480, "width": 832, "num_frames": 10**8})
    assert estimated == []


def test_a_call_key_the_pipeline_does_not_take_is_its_own_error_whatever_its_size(tiny_flux):
    from pipelines.errors import CallSpecError

    with pytest.raises(CallSpecError, match="unknown keyword 'strength'"):  # FluxPipeline takes none (img2img does)
        Pipeline.plan_placement(tiny_flux, max_memory=BUDGETS, call={"strength": HUGE})


@pytest.mark.parametrize("file", ["model_index.json", "transformer/config.json"])
def test_json_nested_without_end_is_named_with_the_limit(tiny_flux, tmp_path, file):
    folder = tmp_path / "pipe"
    shutil.copytree(tiny_flux, folder)
    (folder / file).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FolderError, match=rf"{file}' nests its JSON more than 64 levels deep"):
        Pipeline.plan_placement(folder, max_memory=BUDGETS)


def test_json_depth_is_measured_without_recursion():
    from pipelines.checkpoint.files import json_depth

    assert (json_depth(1), json_depth([]), json_depth({"a": [1, {"b": 2}]})) == (0, 1, 3)
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert json_depth(nested) == 65  # stops descending past the limit

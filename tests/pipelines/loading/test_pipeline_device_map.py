"""Pipeline.from_pretrained(device_map=...) and plan_placement: plan on meta, stream, dispatch, guards, reset,
components passed in, dtype dicts, bad values, and a failed load that leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import pipelines.loading.placing as placing
import pipelines.loading.pipeline_loader as pipeline_loading
from hooks.errors import OffloadConflictError
from pipelines import DiT, Pipeline, TextToImagePipeline
from pipelines.errors import CallSpecError, FolderError
from placement.errors import InvalidDeviceError, PlanError
from placement.sizing import size_module
from placement.streaming import streaming_working_set

from own_fixtures import (USER_IDS, TinyUserPipeline, generate, has_hooks, holds_no_copy, save_preset,
                               tiny_user_pipeline)
from same_output import assert_same_output

pytestmark = pytest.mark.filterwarnings("ignore:No accelerator to plan for")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-dit saved once for the module, with the images the in-memory pipeline makes."""
    folder, pipe = save_preset(tmp_path_factory.mktemp("pipes") / "tiny-dit")
    return folder, generate(pipe)


def load(folder, **kwargs) -> TextToImagePipeline:
    return TextToImagePipeline.from_pretrained(folder, device_map="balanced", progress=False, **kwargs)


def component_bytes(folder) -> dict[str, int]:
    plan = TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"})
    return {name: component.bytes for name, component in plan.components.items()}


def test_balanced_load_gives_the_in_memory_images_and_is_device_mapped(saved):
    folder, expected = saved
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = load(folder)
    degrade = [w for w in caught if "No accelerator" in str(w.message)]
    assert len(degrade) == 1  # one warning, not one per component
    assert degrade[0].filename == __file__  # it points at the caller's line, not at the library's insides
    assert_same_output(generate(pipe), expected)
    assert pipe.hf_device_map == {name: "cpu" for name in ("text_encoder", "text_encoder_2", "denoiser", "vae")}
    assert pipe.denoiser.hf_device_map == {"": "cpu"}
    assert pipe.placement_plan.device_map == pipe.hf_device_map
    assert has_hooks(pipe)  # dispatched like on a GPU machine: the same code path everywhere


def test_guards_then_reset_removes_every_hook_and_allows_to(saved):
    folder, expected = saved
    pipe = load(folder)
    for attempt in (lambda: pipe.to("cpu"), lambda: pipe.to(torch.float16), lambda: pipe.to(dtype=torch.float64)):
        with pytest.raises(OffloadConflictError, match=r"reset_device_map\(\)"):
            attempt()
    if hasattr(pipe, "enable_model_cpu_offload"):
        with pytest.raises(OffloadConflictError, match=r"reset_device_map\(\)"):
            pipe.enable_model_cpu_offload()
    pipe.reset_device_map()
    assert has_hooks(pipe) == []
    assert pipe.hf_device_map is None and pipe.denoiser.hf_device_map is None
    assert {p.device.type for m in pipe.module_components.values() for p in m.parameters()} == {"cpu"}
    pipe.to(torch.float64).to(torch.float32)
    assert_same_output(generate(pipe), expected)


def test_plan_for_two_fictitious_gpus_spans_both_and_loses_nothing(saved):
    folder, _ = saved
    sizes = component_bytes(folder)
    budget = int(sum(sizes.values()) * 0.6)  # neither GPU holds everything; together they do
    plan = TextToImagePipeline.plan_placement(folder, max_memory={0: f"{budget}B", 1: f"{budget}B"})
    assert set(plan.components) == set(sizes)
    assert {d for c in plan.components.values() for d in c.devices} == {0, 1}
    assert all(c.kind.value in ("whole", "split") for c in plan.components.values())
    assert set(name.split(".")[0] for name in plan.device_map) == set(sizes)
    # Loading that plan here is refused with a clear error: this machine has no such GPUs.
    with pytest.raises(InvalidDeviceError, match=r"accelerator\(s\) \[0, 1\].*plan_placement"):
        load(folder, max_memory={0: f"{budget}B", 1: f"{budget}B"})


def test_plan_placement_reads_no_weights(saved, tmp_path):
    folder, _ = saved
    configs_only = tmp_path / "configs"
    for path in folder.rglob("*"):
        if path.is_file() and path.suffix != ".safetensors":
            target = configs_only / path.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    plan = TextToImagePipeline.plan_placement(configs_only, max_memory={0: "1GiB", 1: "1GiB"})
    assert plan.components["denoiser"].bytes == component_bytes(folder)["denoiser"]


def test_user_pipeline_with_user_models_loads_device_mapped(tmp_path):
    pipe = tiny_user_pipeline()
    expected = pipe(USER_IDS)
    pipe.save_pretrained(tmp_path / "user")
    loaded = TinyUserPipeline.from_pretrained(tmp_path / "user", device_map="balanced", progress=False)
    assert_same_output(loaded(USER_IDS), expected)
    assert set(loaded.hf_device_map) == {"encoder", "denoiser", "decoder"}
    plan = TinyUserPipeline.plan_placement(tmp_path / "user", max_memory={0: "1000B", 1: "1000B"})
    assert plan.components["denoiser"].kind.value == "split"  # cut only between its Blocks
    assert all(key.startswith("blocks.") or key == "scale" or "." not in key
               for key in plan.components["denoiser"].device_map)


def test_plain_passed_component_is_sized_and_placed_with_the_rest(saved):
    folder, expected = saved
    denoiser = DiT.from_pretrained(folder / "denoiser")
    pipe = load(folder, denoiser=denoiser)
    assert pipe.denoiser is denoiser
    assert pipe.placement_plan.components["denoiser"].pinned is False
    assert pipe.hf_device_map["denoiser"] == "cpu"
    assert_same_output(generate(pipe), expected)
    # Sized from the object, not from the folder: a bf16 denoiser passed in counts at its own size.
    half = DiT.from_pretrained(folder / "denoiser", torch_dtype=torch.bfloat16)
    own = sum(t.numel() * t.element_size() for t in half.state_dict().values())
    assert 2 * own == pytest.approx(component_bytes(folder)["denoiser"], rel=0.01)
    plan = TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB", 1: "1GiB"}, denoiser=half)
    assert plan.components["denoiser"].bytes == own == sum(plan.components["denoiser"].placed_bytes.values())


def test_device_mapped_passed_component_is_pinned_and_never_moved(saved, tmp_path):
    folder, expected = saved
    denoiser = DiT.from_pretrained(folder / "denoiser", device_map="auto", max_memory={"cpu": "20000B"},
                                   offload_folder=tmp_path / "offload", progress=False)
    own_map = dict(denoiser.hf_device_map)
    assert "disk" in own_map.values()
    hooks_before = has_hooks(denoiser)
    pipe = load(folder, denoiser=denoiser)
    assert pipe.placement_plan.components["denoiser"].pinned is True
    assert denoiser.hf_device_map == own_map and has_hooks(denoiser) == hooks_before
    shown = {key.removeprefix("denoiser").lstrip("."): device
             for key, device in pipe.hf_device_map.items() if key.startswith("denoiser")}
    assert shown == own_map
    assert_same_output(generate(pipe), expected)


def test_dtype_dict_per_component_with_and_without_device_map(saved):
    folder, _ = saved
    dtypes = {"denoiser": torch.bfloat16, "default": torch.float32}
    for pipe in (load(folder, torch_dtype=dtypes), TextToImagePipeline.from_pretrained(folder, torch_dtype=dtypes)):
        found = {name: next(m.parameters()).dtype for name, m in pipe.module_components.items()}
        assert found == {"text_encoder": torch.float32, "text_encoder_2": torch.float32,
                         "denoiser": torch.bfloat16, "vae": torch.float32}
        assert generate(pipe).dtype == torch.float32
    plan = TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"}, torch_dtype=dtypes)
    full = component_bytes(folder)
    assert plan.components["denoiser"].bytes == full["denoiser"] // 2
    assert plan.components["vae"].bytes == full["vae"]


def test_a_misspelt_dtype_key_is_an_error_naming_it_and_the_components(saved):
    """{"denoser": bf16} used to load the denoiser in float32 without a word."""
    from placement.errors import PlanError

    folder, _ = saved
    dtypes = {"denoser": torch.bfloat16, "default": torch.float32}
    calls = (lambda: load(folder, torch_dtype=dtypes),
             lambda: TextToImagePipeline.from_pretrained(folder, torch_dtype=dtypes),
             lambda: TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"}, torch_dtype=dtypes))
    for call in calls:
        with pytest.raises(PlanError, match=r"\['denoser'\].*'denoiser', 'text_encoder'.*'default'"):
            call()
    tokenizer_key = {"tokenizer": torch.float16}  # a component, but not a module: nothing to cast
    with pytest.raises(PlanError, match=r"\['tokenizer'\], which are not module components"):
        TextToImagePipeline.plan_placement(folder, max_memory={0: "1GiB"}, torch_dtype=tokenizer_key)


def test_unknown_device_map_string_lists_the_supported_ones(saved):
    folder, _ = saved
    with pytest.raises(PlanError, match="'fastest'.*balanced.*sequential.*balanced_low_0"):
        load_with = TextToImagePipeline.from_pretrained
        load_with(folder, device_map="fastest")


def test_single_device_cpu_places_everything_without_hooks(saved):
    folder, expected = saved
    pipe = TextToImagePipeline.from_pretrained(folder, device_map="cpu", progress=False)
    assert set(pipe.hf_device_map.values()) == {"cpu"} and has_hooks(pipe) == []
    assert_same_output(generate(pipe), expected)
    with pytest.raises(OffloadConflictError, match="reset_device_map"):
        pipe.to(torch.float16)


def test_generic_pipeline_of_our_folder_is_device_mapped_in_its_graph_order(saved):
    folder, _ = saved
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", progress=False)
    assert type(pipe) is Pipeline
    assert pipe.execution_order == ["text_encoder", "text_encoder_2", "denoiser", "vae"]
    assert set(pipe.hf_device_map) == set(pipe.execution_order)


def test_a_corrupt_weights_file_fails_before_anything_is_loaded(saved, tmp_path, monkeypatch):
    folder, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    vae_weights = broken / "vae" / "diffusion_pytorch_model.safetensors"
    vae_weights.write_bytes(vae_weights.read_bytes()[:-64])  # the last component's file is truncated
    streamed = []
    monkeypatch.setattr(placing, "stream_weights", lambda module, *a, **k: streamed.append(module))
    with pytest.raises(FolderError, match="vae"):
        load(broken)
    assert streamed == []  # headers are checked while sizing, before the first tensor moves


def test_failed_load_leaves_nothing_behind(saved, monkeypatch):
    folder, _ = saved
    built, stream = {}, placing.stream_weights  # the one loader of planned weights (place_component)
    construct = pipeline_loading.construct

    def spy(*args, **kwargs):
        built["pipe"] = construct(*args, **kwargs)
        return built["pipe"]

    def fail_on_the_vae(module, *args, **kwargs):
        if module is built["pipe"].vae:
            raise RuntimeError("injected failure while streaming the vae")
        return stream(module, *args, **kwargs)

    monkeypatch.setattr(pipeline_loading, "construct", spy)
    monkeypatch.setattr(placing, "stream_weights", fail_on_the_vae)
    passed_encoder = TextToImagePipeline.from_preset("tiny-dit").text_encoder
    weights_before = {k: v.clone() for k, v in passed_encoder.state_dict().items()}
    with pytest.raises(RuntimeError, match="injected"):
        load(folder, text_encoder=passed_encoder)
    pipe = built["pipe"]
    assert has_hooks(pipe) == [] and pipe.hf_device_map is None
    # What was loaded went back to meta (freed); what was passed in is intact on the CPU.
    for name in ("text_encoder_2", "denoiser"):
        assert {p.device.type for p in pipe.components[name].parameters()} == {"meta"}
    assert all(torch.equal(passed_encoder.state_dict()[k], v) for k, v in weights_before.items())
    assert getattr(passed_encoder, "hf_device_map", None) is None


def test_model_index_written_by_save_names_every_component(saved):
    folder, _ = saved
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "TextToImagePipeline"
    assert index["denoiser"] == ["pipelines", "DiT"]
    assert index["tokenizer"] == ["pipelines", "ByteTokenizer"]
    assert index["scheduler"] == ["pipelines", "FlowMatchEulerScheduler"]


def test_plans_size_the_checkpoints_own_dtype_unless_torch_dtype_overrides(saved, tmp_path):
    folder, _ = saved
    half = TextToImagePipeline.from_pretrained(folder).to(torch.float16)
    half.save_pretrained(tmp_path / "fp16")
    full = component_bytes(folder)
    planned = TextToImagePipeline.plan_placement(tmp_path / "fp16", max_memory={0: "1GiB"})
    assert {name: c.bytes for name, c in planned.components.items()} == {n: b // 2 for n, b in full.items()}
    upcast = TextToImagePipeline.plan_placement(tmp_path / "fp16", max_memory={0: "1GiB"}, torch_dtype=torch.float32)
    assert {name: c.bytes for name, c in upcast.components.items()} == full
    loaded = load(tmp_path / "fp16")
    assert {next(m.parameters()).dtype for m in loaded.module_components.values()} == {torch.float16}


def test_from_pretrained_with_a_call_plans_for_its_activations(saved):
    folder, expected = saved
    pipe = load(folder, call={"height": 16, "width": 16, "batch_size": 1})
    assert pipe.placement_plan.activations_accounted
    assert all(c.activation_bytes > 0 for c in pipe.placement_plan.components.values())
    assert_same_output(generate(pipe), expected)
    with pytest.raises(CallSpecError, match="call=.*does not fit"):
        load(folder, call={"resolution": 16})


def test_loading_shows_one_progress_bar_in_bytes_labelled_by_component(saved, monkeypatch):
    """One tqdm bar for the whole load, created with disable=None (shown on terminals, quiet in logs), counting
    the bytes loaded and relabelled with each component as it is read; progress=False turns it off."""
    import pipelines.checkpoint.streaming as progress

    bars = []

    class Recorder(progress.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps, self.labels = 0, []  # tqdm stops counting once it finds no terminal; count here
            bars.append((kwargs["disable"], self))

        def update(self, n=1):
            self.steps += n
            return super().update(n)

        def set_description(self, desc=None, refresh=True):
            self.labels.append(desc)
            return super().set_description(desc, refresh)

    monkeypatch.setattr(progress, "tqdm", Recorder)
    folder, _ = saved
    pipe = TextToImagePipeline.from_pretrained(folder, device_map="balanced")
    ((disable, bar),) = bars
    loaded = sum(t.numel() * t.element_size()
                 for m in pipe.module_components.values() for t in m.state_dict().values())
    assert disable is None and bar.total == bar.steps == loaded
    assert bar.labels == [f"Loading {name}" for name in pipe.placement_plan.components]
    bars.clear()
    load(folder)
    assert bars and all(disable is True for disable, _ in bars)


def ram_that_sends_one_component_to_disk(folder) -> int:
    """A CPU budget for all but one component, plus the room to run that one streamed from the disk. Tiny
    models are mostly embeddings, so which component can stream in less than its size is found by planning."""
    sizes = component_bytes(folder)
    meta = TextToImagePipeline.from_preset("tiny-dit", device="meta")
    for name, size in sorted(sizes.items(), key=lambda item: item[1]):
        module = getattr(meta, name)
        ram = sum(sizes.values()) - size + streaming_working_set(module, size_module(module))
        plan = TextToImagePipeline.plan_placement(folder, max_memory={"cpu": f"{ram}B"}, offload_folder="unused")
        if any(c.kind.value == "disk" for c in plan.components.values()):
            return ram
    raise AssertionError("no CPU budget sends a tiny-dit component to disk")


def test_components_planned_to_disk_are_served_from_the_checkpoint_and_match(saved, tmp_path):
    folder, expected = saved
    pipe = load(folder, max_memory={"cpu": f"{ram_that_sends_one_component_to_disk(folder)}B"},
                offload_folder=tmp_path / "offload")
    on_disk = [name for name, c in pipe.placement_plan.components.items() if c.kind.value == "disk"]
    assert on_disk and all(pipe.hf_device_map[name] == "disk" for name in on_disk)
    for name in on_disk:  # nothing resident between calls
        assert all(p.device.type == "meta" for p in pipe.components[name].parameters())
    assert holds_no_copy(tmp_path / "offload", folder)  # served from the checkpoint (pinned by links): no copy
    assert_same_output(generate(pipe), expected)
    pipe.reset_device_map()
    assert not has_hooks(pipe)
    assert all(p.device.type == "cpu" for name in on_disk for p in pipe.components[name].parameters())

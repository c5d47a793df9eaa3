"""LoRA on placed diffusers pipelines: a tiny FLUX pipeline (written by diffusers), two LoRAs made by peft
(saved with diffusers' `save_lora_weights`), and every placement kind of its transformer over two virtual
GPUs: load, set_adapters, fuse, unfuse, delete_adapters and unload give exactly what the plain diffusers
pipeline gives after the same calls; fusing into weights on disk and set_lora_device are refused with an
error that names the component and says what to do, and change nothing."""

from __future__ import annotations

import pytest
import torch

from hooks import weight_homes
from hooks.errors import OffloadConflictError
from pipelines import Pipeline
from pipelines.checkpoint import CheckpointShapeError
from placement.plan_schema import ComponentTransfer, PlacementKind

peft = pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from same_output import assert_same_output
from test_diffusers_pipelines import build_flux  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:No LoRA keys", "ignore:Already unmerged")
MEMORY = {0: "1GiB", 1: "1GiB", "cpu": "4GiB"}
OTHER_PARTS = {"text_encoder": 0, "text_encoder_2": 1, "vae": 1}

# The calls a user makes, in order; "fuse" and "unfuse" are left out where fusing is refused (disk).
WITH_FUSE = ("load a", "load b, mix", "fuse", "unfuse", "delete b", "unload")
WITHOUT_FUSE = ("load a", "load b, mix", "delete b", "unload")


def make_lora(folder, pipe, seed):
    torch.manual_seed(seed)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                            target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"]))
    state = get_peft_model_state_dict(pipe.transformer)
    pipe.transformer.delete_adapters("default")
    diffusers.FluxPipeline.save_lora_weights(folder, transformer_lora_layers=state)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    build_flux(root / "parts").save_pretrained(root / "flux")
    plain = diffusers.FluxPipeline.from_pretrained(root / "flux")
    make_lora(root / "a", plain, seed=1)
    make_lora(root / "b", plain, seed=2)
    return root


def generate(pipe):
    with torch.no_grad():
        images = pipe(prompt="a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0),
                      output_type="pt", height=8, width=8, max_sequence_length=8).images
    return images.to("cpu")


def denoise(pipe):
    """One run of the transformer alone (a whole generation is checked once per placement: it costs ten)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 16, 4, generator=generator),
              "encoder_hidden_states": torch.randn(1, 8, 32, generator=generator),
              "pooled_projections": torch.randn(1, 32, generator=generator), "timestep": torch.tensor([0.5]),
              "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}
    with torch.no_grad():
        return pipe.transformer(**inputs).sample.to("cpu")


def step(pipe, call, root):
    if call == "load a":
        pipe.load_lora_weights(root / "a", adapter_name="a")
    elif call == "load b, mix":
        pipe.load_lora_weights(root / "b", adapter_name="b")
        pipe.set_adapters(["a", "b"], adapter_weights=[1.0, 0.5])
    elif call == "fuse":
        pipe.fuse_lora(components=["transformer"])
    elif call == "unfuse":
        pipe.unfuse_lora(components=["transformer"])
    elif call == "delete b":
        pipe.delete_adapters("b")
    elif call == "unload":
        pipe.unload_lora_weights()


@pytest.fixture(scope="module")
def expected(flux):
    """What the plain diffusers pipeline's transformer computes before and after each call of each sequence,
    and the image it generates with LoRA "a" loaded."""
    outputs = {}
    for calls in (WITH_FUSE, WITHOUT_FUSE):
        plain = diffusers.FluxPipeline.from_pretrained(flux / "flux")
        outputs[calls] = [denoise(plain)]
        for call in calls:
            step(plain, call, flux)
            outputs[calls].append(denoise(plain))
            if call == "load a":
                outputs["image with a"] = generate(plain)
    return outputs


def with_transformer(plan, **changes):
    """`plan` with its transformer's placement changed (how a user pins a placement the planner would not pick)."""
    components = dict(plan.components)
    components["transformer"] = components["transformer"].model_copy(update=changes)
    return plan.model_copy(update={"components": components})


def group_offloaded(folder):
    plan = Pipeline.plan_placement(folder, device_map={"transformer": 0, **OTHER_PARTS}, max_memory=MEMORY)
    size = plan.components["transformer"].bytes
    return with_transformer(plan, kind=PlacementKind.OFFLOADED, device_map={"": "cpu"}, devices=["cpu"],
                            placed_bytes={"cpu": size}, execution_device=0)


def per_call(home):
    def plan_for(folder):
        plan = Pipeline.plan_placement(folder, device_map={"transformer": 0, **OTHER_PARTS}, max_memory=MEMORY)
        device_map = {"x_embedder": 0, "pos_embed": 0, "time_text_embed": 0, "context_embedder": 0, "norm_out": 0,
                      "proj_out": 0, "transformer_blocks": "cpu", "single_transformer_blocks": home}
        transfer = ComponentTransfer(per_call_modules=["transformer_blocks"],
                                     streamed_modules=["single_transformer_blocks"])
        return with_transformer(plan, kind=PlacementKind.OFFLOADED, device_map=device_map, transfer=transfer)

    return plan_for


PLACEMENTS = {  # name: (device_map, or a function of the folder giving a Plan; the calls that work there)
    "whole": ({"transformer": 0, **OTHER_PARTS}, WITH_FUSE),
    # proj_out (a LoRA target) is an entry of its own whose input arrives from GPU 1
    "split": ({"transformer": {"transformer_blocks": 0, "single_transformer_blocks": 1, "norm_out": 1, "": 0},
               **OTHER_PARTS}, WITH_FUSE),
    "cpu": ({"transformer": "cpu", **OTHER_PARTS}, WITH_FUSE),
    "offloaded, group": (group_offloaded, WITH_FUSE),
    "offloaded, part resident": ({"transformer": {"": "cpu", "x_embedder": 0}, **OTHER_PARTS}, WITH_FUSE),
    "per-call residency": (per_call("cpu"), WITH_FUSE),
    "per-call residency, disk": (per_call("disk"), WITHOUT_FUSE),
    "disk": ({"transformer": "disk", **OTHER_PARTS}, WITHOUT_FUSE),
}


def load(flux, placement):
    device_map, _ = PLACEMENTS[placement]
    if callable(device_map):
        device_map = device_map(flux / "flux")
    return Pipeline.from_pretrained(flux / "flux", device_map=device_map, max_memory=MEMORY,
                                    offload_folder=flux / "offload", progress=False)


@pytest.fixture
def gpus(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_adapter_call_gives_what_diffusers_gives(placement, flux, expected, gpus):
    pipe = load(flux, placement)
    calls = PLACEMENTS[placement][1]
    assert_same_output(denoise(pipe), expected[calls][0])
    for index, call in enumerate(calls, start=1):
        step(pipe, call, flux)
        assert_same_output(denoise(pipe), expected[calls][index], msg=f"after {call!r} on {placement}")
        if call == "load a":
            assert_same_output(generate(pipe), expected["image with a"])
    assert not [name for name in weight_homes(pipe.transformer) if "lora" in name]


@pytest.mark.parametrize("placement, lora_home", [
    ("whole", 0), ("offloaded, group", "cpu"), ("disk", "cpu"), ("per-call residency, disk", "cpu"),
])
def test_the_lora_lives_beside_its_layer(placement, lora_home, flux, gpus):
    pipe = load(flux, placement)
    pipe.load_lora_weights(flux / "a", adapter_name="a")
    homes = weight_homes(pipe.transformer)
    lora = {name: home for name, home in homes.items() if "single_transformer_blocks.0.attn.to_q.lora" in name}
    assert lora and set(lora.values()) == {lora_home}


@pytest.mark.parametrize("placement", ["disk", "offloaded, group", "per-call residency, disk"])
def test_low_memory_loading_and_hotswapping_follow_the_layer_too(placement, flux, gpus):
    plain = diffusers.FluxPipeline.from_pretrained(flux / "flux")
    pipe = load(flux, placement)
    for target in (plain, pipe):  # peft assigns the loaded tensors, then copies the second LoRA into them
        target.load_lora_weights(flux / "a", adapter_name="a", low_cpu_mem_usage=True)
    assert_same_output(denoise(pipe), denoise(plain))
    for target in (plain, pipe):
        target.load_lora_weights(flux / "b", adapter_name="a", hotswap=True)
    assert_same_output(denoise(pipe), denoise(plain))


@pytest.mark.parametrize("placement", ["disk", "per-call residency, disk"])
def test_fusing_into_weights_on_disk_is_refused_before_anything_changes(placement, flux, expected, gpus):
    pipe = load(flux, placement)
    for call in WITHOUT_FUSE[:2]:
        step(pipe, call, flux)
    # After a call, per-call units stay loaded on their GPU until their room is needed: still homed on disk (the
    # refusal read the home from the tensors, which were on the GPU then, and the fuse wrote into stand-ins).
    denoise(pipe)
    with pytest.raises(OffloadConflictError, match=r"fuse_lora\(\): transformer .*on disk.*before placing"):
        pipe.fuse_lora(components=["transformer"])
    assert not pipe.transformer.get_submodule("transformer_blocks.0.attn.to_q").merged  # none fused, even in RAM
    assert_same_output(denoise(pipe), expected[WITHOUT_FUSE][2])
    with pytest.raises(OffloadConflictError, match=r"fuse_lora\(\): transformer"):
        pipe.transformer.fuse_lora()  # the model's own method too


def test_set_lora_device_is_refused_on_a_placed_pipeline(flux, gpus):
    pipe = load(flux, "whole")
    pipe.load_lora_weights(flux / "a", adapter_name="a")
    with pytest.raises(OffloadConflictError, match=r"set_lora_device.*'transformer'.*reset_device_map"):
        pipe.set_lora_device(["a"], "cpu")


def test_after_reset_the_lora_stays_and_the_methods_are_diffusers_own(flux, expected, gpus):
    pipe = load(flux, "disk")
    pipe.load_lora_weights(flux / "a", adapter_name="a")
    pipe.reset_device_map()
    pipe.to("cpu")
    assert_same_output(generate(pipe), expected["image with a"])
    pipe.fuse_lora(components=["transformer"])  # in RAM now: fusing works
    pipe.set_lora_device(["a"], "cpu")


# Each placement kind of the CLIP text encoder (transformers' own load_adapter path): whole on a GPU, split over
# two, run on the CPU, offloaded to host RAM and executed on a GPU, homed on disk.
TEXT_ENCODER_PLACEMENTS = {
    "whole": 0, "split": {"encoder.layers.0": 1, "": 0}, "cpu": "cpu",
    "offloaded": {"": "cpu", "embeddings": 0}, "disk": "disk",
}


@pytest.fixture(scope="module")
def text_encoder_lora(flux):
    plain = diffusers.FluxPipeline.from_pretrained(flux / "flux")
    torch.manual_seed(4)
    plain.text_encoder.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                              target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]))
    diffusers.FluxPipeline.save_lora_weights(flux / "te",
                                             text_encoder_lora_layers=get_peft_model_state_dict(plain.text_encoder))
    reference = diffusers.FluxPipeline.from_pretrained(flux / "flux")
    reference.load_lora_weights(flux / "te")
    return generate(reference)


@pytest.mark.parametrize("placement", TEXT_ENCODER_PLACEMENTS)
def test_a_text_encoder_lora_follows_the_text_encoder_wherever_it_is(placement, flux, text_encoder_lora, gpus):
    device_map = {"transformer": 0, "text_encoder": TEXT_ENCODER_PLACEMENTS[placement], "text_encoder_2": 1, "vae": 1}
    pipe = Pipeline.from_pretrained(flux / "flux", device_map=device_map, max_memory=MEMORY,
                                    offload_folder=flux / "offload", progress=False)
    pipe.load_lora_weights(flux / "te")
    assert_same_output(generate(pipe), text_encoder_lora)
    pipe.unload_lora_weights()
    assert not _has_lora(pipe.text_encoder)


def _has_lora(module):
    return any("lora_" in name for name, _ in module.named_parameters())


@pytest.mark.parametrize("placement", ["whole", "disk"])
@pytest.mark.parametrize("with_a", [False, True])
def test_a_lora_of_the_wrong_rank_is_named_and_leaves_the_pipeline_as_it_was(placement, with_a, flux, gpus):
    state = diffusers.FluxPipeline.lora_state_dict(flux / "a")
    state = state[0] if isinstance(state, tuple) else state
    wrong = {key: torch.zeros(value.shape[0], 2 * value.shape[1]) if "lora_B" in key else value
             for key, value in state.items()}  # lora_B of rank 8 beside lora_A of rank 4
    diffusers.FluxPipeline.save_lora_weights(flux / "wrong", transformer_lora_layers={
        key.removeprefix("transformer."): value for key, value in wrong.items()})
    pipe = load(flux, placement)
    if with_a:
        pipe.load_lora_weights(flux / "a", adapter_name="a")
    keys, output = set(pipe.transformer.state_dict()), denoise(pipe)
    with pytest.raises(CheckpointShapeError, match=rf"load_lora_weights\('{flux / 'wrong'}'\).*size mismatch for "
                                                   r"\S+lora_A\S*: .*torch.Size\(\[4, \d+\]\).*torch.Size\(\[8, "):
        pipe.load_lora_weights(flux / "wrong", adapter_name="wrong")
    assert set(pipe.transformer.state_dict()) == keys
    assert set(getattr(pipe.transformer, "peft_config", {}) or {}) == ({"a"} if with_a else set())
    assert_same_output(denoise(pipe), output)


def _cut_in_half(flux, folder):
    source = flux / "a" / "pytorch_lora_weights.safetensors"
    folder.mkdir(exist_ok=True)
    (folder / source.name).write_bytes(source.read_bytes()[: source.stat().st_size // 2])


def _keys_of_no_layer(flux, folder):
    diffusers.FluxPipeline.save_lora_weights(folder, transformer_lora_layers={
        "single_transformer_blocks.7.no_such_layer.lora_A.weight": torch.zeros(4, 4),
        "single_transformer_blocks.7.no_such_layer.lora_B.weight": torch.zeros(4, 4)})


def _no_lora_names(flux, folder):
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    save_file({"some.weight": torch.zeros(3)}, str(folder / "pytorch_lora_weights.safetensors"))


@pytest.mark.parametrize("placement", ["whole", "disk"])
@pytest.mark.parametrize("make, says", [(_cut_in_half, "cannot be read .*Unable to load weights .*cut short"),
                                        (_keys_of_no_layer, "adapt no layer .*NoMatchingPeftModuleError"),
                                        (_no_lora_names, "adapt no layer .*Invalid LoRA checkpoint")])
def test_a_cut_lora_or_one_whose_keys_match_nothing_is_named_and_changes_nothing(placement, flux, gpus, make, says):
    """diffusers and peft said these with a raw OSError, NoMatchingPeftModuleError or ValueError."""
    from pipelines.errors import FolderError

    folder = flux / f"bad-{make.__name__}"
    make(flux, folder)
    pipe = load(flux, placement)
    pipe.load_lora_weights(flux / "a", adapter_name="a")
    keys, output = set(pipe.transformer.state_dict()), denoise(pipe)
    with pytest.raises(FolderError, match=rf"load_lora_weights\('{folder}'\): .*{says}") as raised:
        pipe.load_lora_weights(folder, adapter_name="bad")
    assert "The pipeline is unchanged" in str(raised.value)
    assert set(pipe.transformer.state_dict()) == keys and set(pipe.transformer.peft_config) == {"a"}
    assert_same_output(denoise(pipe), output)


def test_a_pipeline_loaded_without_device_map_names_a_bad_lora_and_still_pickles(flux, expected):
    """Issue 42's gap: without device_map the adapter load was diffusers' own, and a bad file its raw error."""
    import copy
    import pickle

    from pipelines.errors import FolderError

    folder = flux / "bad-unplaced"
    _cut_in_half(flux, folder)
    pipe = Pipeline.from_pretrained(flux / "flux", progress=False)
    keys = set(pipe.transformer.state_dict())
    with pytest.raises(FolderError, match=rf"load_lora_weights\('{folder}'\): .*cannot be read .*cut short"):
        pipe.load_lora_weights(folder, adapter_name="bad")
    assert set(pipe.transformer.state_dict()) == keys and not getattr(pipe.transformer, "peft_config", None)
    pipe.load_lora_weights(flux / "a", adapter_name="a")
    assert_same_output(generate(pipe), expected["image with a"])
    copied = copy.deepcopy(pipe)
    assert copied.load_lora_weights.owner is copied  # the copy's loads go to the copy
    assert type(pickle.loads(pickle.dumps(pipe))) is type(pipe)

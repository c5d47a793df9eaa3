"""Block-level group offloading finds block lists below the root (transformers T5 keeps its blocks under
`encoder.block`, a diffusers VAE under `encoder.down_blocks` / `decoder.up_blocks`), and the planner sizes
an offloaded component from the same layout (`placement.streaming.block_groups`), so what the plan charges
the execution device is what the runtime keeps there.
"""

import warnings

import pytest
import torch
from accelerate import init_empty_weights
from torch import nn

import placement
from hooks import GroupOffloadingConfig, apply_group_offloading, group_offloading_session, remove_group_offloading
from hooks.techniques import apply_plan
from placement.devices import torch_device
from placement.sizing import size_module
from placement.streaming import block_groups, streaming_working_set, transfer_units
from resident_weights import place_resident_weights
from same_output import assert_same_output

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

TOKENS = torch.tensor([[1, 5, 7, 2], [3, 3, 9, 0]])
T5_CONFIG = dict(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_heads=4,
                 relative_attention_num_buckets=8, dropout_rate=0.0)


def tiny_t5(on_meta: bool = False) -> nn.Module:
    config = transformers.T5Config(**T5_CONFIG)
    torch.manual_seed(0)
    if on_meta:
        with init_empty_weights():
            model = transformers.T5EncoderModel(config)
        model.tie_weights()  # tying inside init_empty_weights() does not stick
        return model
    return transformers.T5EncoderModel(config).eval()


def test_t5_blocks_are_found_under_the_encoder():
    layout = block_groups(tiny_t5())
    assert layout.block_paths == ["encoder.block.0", "encoder.block.1", "encoder.block.2"]
    rest = [path for path, _ in layout.rest_modules]
    assert rest == ["", "shared", "encoder", "encoder.embed_tokens", "encoder.final_layer_norm", "encoder.dropout"]


class Nested(nn.Module):
    """Blocks two levels down, a tensor held by the module descended through, a leaf child beside it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Module()
        self.body.inner = nn.Module()
        self.body.inner.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.body.inner.gain = nn.Parameter(torch.ones(4))
        self.body.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)


def test_block_lists_at_any_depth_and_what_stays_in_the_rest():
    model = Nested()
    layout = block_groups(model)
    assert layout.block_paths == ["body.inner.layers.0", "body.inner.layers.1", "body.inner.layers.2"]
    assert [path for path, _ in layout.rest_modules] == ["", "body", "body.inner", "body.norm", "head"]
    size = size_module(model)
    block = size.module_sizes["body.inner.layers.0"]
    assert streaming_working_set(model, size) == size.total - block  # rest + two of the three blocks
    flat = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert [path for path in block_groups(flat).block_paths] == ["0", "1"]  # the root itself is the list


def resident_log(model, session, blocks):
    """Record, from inside each block's forward (after its group is onloaded), the resident groups and bytes."""
    log = []

    def record(module, args):
        groups = session.resident_groups
        log.append((sorted(group.name for group in groups), sum(group.num_bytes for group in groups)))

    handles = [block.layer[0].register_forward_pre_hook(record) for block in blocks]
    return log, handles


@pytest.mark.parametrize("to_disk", [False, True], ids=["ram", "disk"])
def test_t5_group_offload_equals_plain_and_keeps_rest_plus_one_block(to_disk, tmp_path):
    model = tiny_t5()
    with torch.no_grad():
        expected = model(input_ids=TOKENS).last_hidden_state
    config = GroupOffloadingConfig(onload_device="cpu", offload_to_disk_path=tmp_path if to_disk else None)
    apply_group_offloading(model, config)
    session = group_offloading_session(model)
    names = [group.name for group in session.groups]
    assert names == ["rest", "encoder.block.0", "encoder.block.1", "encoder.block.2"]
    log, handles = resident_log(model, session, model.encoder.block)
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(model(input_ids=TOKENS).last_hidden_state, expected)
            assert session.resident_groups == []
    one_at_a_time = [["encoder.block.0", "rest"], ["encoder.block.1", "rest"], ["encoder.block.2", "rest"]]
    # On disk, from the second call on (the first records the order), the next block is read ahead while one
    # computes (`read_ahead`): two blocks at once, as a side stream prefetches them.
    read_ahead = [["encoder.block.0", "encoder.block.1", "rest"], ["encoder.block.1", "encoder.block.2", "rest"],
                  ["encoder.block.2", "rest"]]
    assert [groups for groups, _ in log] == one_at_a_time + (read_ahead if to_disk else one_at_a_time)
    assert model.shared.weight is model.encoder.embed_tokens.weight  # the tie survives the swaps
    # The planner's working set (rest + two blocks, the bound with prefetch) covers what was resident.
    plain = tiny_t5(on_meta=True)
    working_set = streaming_working_set(plain, size_module(plain))
    block_bytes = size_module(plain).module_sizes["encoder.block.1"]
    assert max(resident for _, resident in log) == working_set - (0 if to_disk else block_bytes)
    for handle in handles:
        handle.remove()
    remove_group_offloading(model)
    with torch.no_grad():
        assert_same_output(model(input_ids=TOKENS).last_hidden_state, expected)


def test_vae_decode_with_nested_block_lists_equals_plain():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4, layers_per_block=1,
    ).eval()
    layout = block_groups(vae)
    assert "decoder.up_blocks.0" in layout.block_paths and "encoder.down_blocks.1" in layout.block_paths
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        expected = vae.decode(latents).sample
    apply_group_offloading(vae, GroupOffloadingConfig(onload_device="cpu"))
    with torch.no_grad():
        for _ in range(2):  # decode is not forward: the hooked decoder and its children drive the groups
            assert_same_output(vae.decode(latents).sample, expected)
    # Every block went back. (diffusers' `apply_forward_hook` on decode calls the root hook's pre_forward and
    # never its post_forward, so the rest group stays until the next call sweeps it.)
    resident = [group.name for group in group_offloading_session(vae).resident_groups]
    assert resident in ([], ["rest"])


def test_planner_offloads_t5_on_a_gpu_with_room_for_its_working_set():
    model = tiny_t5(on_meta=True)
    size = size_module(model)
    working_set = streaming_working_set(model, size)
    assert working_set < size.total  # before nested lists were found it was all of it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = placement.plan({"text_encoder": model}, max_memory={0: f"{working_set}B", "cpu": f"{10 * size.total}B"})
    encoder = plan.components["text_encoder"]
    assert (encoder.kind, encoder.execution_device) == (placement.PlacementKind.OFFLOADED, 0)
    # Its rest may stay resident beside the blocks in flight (issue 18): the GPU holds exactly the working set.
    assert plan.device(0).weight_bytes + encoder.streamed_unit_bytes == working_set == plan.device(0).predicted_peak
    too_small = placement.plan({"text_encoder": model}, max_memory={0: f"{working_set - 1}B", "cpu": f"{10 * size.total}B"})
    assert too_small.components["text_encoder"].kind is placement.PlacementKind.CPU


@pytest.mark.gpu
def test_t5_stream_prefetch_on_gpu_stays_within_the_planned_working_set():
    model = tiny_t5()
    with torch.no_grad():
        expected = model(input_ids=TOKENS).last_hidden_state
    apply_group_offloading(model, GroupOffloadingConfig(onload_device=0, use_stream=True))
    session = group_offloading_session(model)
    log, handles = resident_log(model, session, model.encoder.block)
    with torch.no_grad():
        for _ in range(2):  # the first call records the order; the second prefetches the next block
            output = model(input_ids=TOKENS).last_hidden_state
            torch.testing.assert_close(output.cpu(), expected, atol=1e-4, rtol=0)
    for handle in handles:
        handle.remove()
    plain = tiny_t5(on_meta=True)
    assert max(resident for _, resident in log) <= streaming_working_set(plain, size_module(plain))
    assert any(len(groups) == 3 for groups, _ in log)  # rest + the running block + the prefetched one
    remove_group_offloading(model)


def ltx2_audio_vae() -> nn.Module:
    """LTX-2's audio VAE, LDM-style: `decoder.up` holds bare `nn.Module()` stages (`block`, `upsample`) and
    `decoder.mid` another; the decoder calls `self.up[i].block[j]`, never a stage, never `mid`."""
    torch.manual_seed(0)
    return diffusers.AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1, 2), num_res_blocks=1,
                                            in_channels=2, resolution=32, latent_channels=2, mel_bins=8).eval()


def test_a_container_that_is_never_called_streams_as_its_called_parts():
    vae = ltx2_audio_vae()
    blocks = block_groups(vae).block_paths
    assert "decoder.up.1" not in blocks and {"decoder.up.1.block.0", "decoder.up.1.upsample"} <= set(blocks)
    assert all(type(vae.get_submodule(path)).forward is not nn.Module.forward for path in blocks)
    size = size_module(vae)
    units = transfer_units(vae, size)
    assert "decoder.mid" not in {unit.path for unit in units} and "decoder.mid.block_1" in {u.path for u in units}
    assert sum(unit.bytes for unit in units) == size.total  # every tensor in exactly one unit


def test_a_vae_whose_stages_are_never_called_streams_on_a_strict_virtual_gpu(monkeypatch):
    """Streamed onto vgpu:0 block by block, then planned with a per-call budget: before, the stage's group never
    loaded (its hook never fired) and a convolution met `vgpu:0 and cpu`."""
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    latents = torch.randn(1, 2, 4, 4)
    expected = ltx2_audio_vae().decode(latents).sample
    vae = ltx2_audio_vae()
    apply_group_offloading(vae, GroupOffloadingConfig(onload_device=torch_device(0)))
    with torch.no_grad():
        assert_same_output(vae.decode(latents).sample.cpu(), expected)
    remove_group_offloading(vae)
    # Planned: a GPU with room for its working set only, the rest streamed (the blocks) block by block.
    vae = ltx2_audio_vae()
    budget = streaming_working_set(vae, size_module(vae))
    plan = placement.plan({"audio_vae": vae}, max_memory={0: f"{budget}B", "cpu": "1GiB"})
    planned = plan.components["audio_vae"]
    assert planned.execution_device == 0 and planned.transfer is not None
    moved = [*planned.transfer.streamed_modules, *planned.transfer.per_call_modules]
    assert {"decoder.up.1.block.0", "decoder.up.1.upsample"} <= set(moved)
    assert all(type(vae.get_submodule(path)).forward is not nn.Module.forward for path in moved)
    place_resident_weights(vae, planned.device_map)
    placed = apply_plan({"audio_vae": vae}, plan)
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(vae.decode(latents.to(torch_device(0))).sample.cpu(), expected)
    placed.remove()

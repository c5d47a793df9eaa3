"""Group offloading on the CPU: outputs equal the plain run, weights sit in the store between calls,
groups are onloaded exactly while they run, and removal leaves plain modules behind.

With no accelerator the onload device is the CPU too, so "where the weights are" is observed through the
disk store (modules hold `meta` placeholders between calls) and through the session's resident groups.
"""

import os

import pytest
import torch
from accelerate.big_modeling import cpu_offload
from accelerate.hooks import remove_hook_from_module
from torch import nn

import hooks.group_offload.offload as group_offload
from hooks import (
    GroupOffloadingConfig,
    OffloadConfigError,
    OffloadConflictError,
    OffloadType,
    apply_group_offloading,
    group_offloading_session,
    remove_group_offloading,
)
from hooks.group_offload.transfer import BlockingTransfer
from same_output import assert_same_output


class Probe(nn.Module):
    """Records which groups are resident while it runs (it holds no weights, so it is never hooked itself)."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log
        self.owner = lambda: None  # set by the model; a plain attribute would register it as a submodule

    def forward(self, x):
        session = group_offloading_session(self.owner())
        if session is not None:
            self.log.append(sorted(group.name for group in session.resident_groups))
        return x


class Tiny(nn.Module):
    def __init__(self, tied: bool = False, blocks: int = 4):
        super().__init__()
        self.log = []
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), Probe(self.log)) for _ in range(blocks))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.register_buffer("scale", torch.tensor(0.5))
        for block in self.blocks:
            block[2].owner = lambda: self
        if tied:
            self.head.weight = self.embed.weight
        self.fail_in_block = None

    def forward(self, tokens):
        x = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            if index == self.fail_in_block:
                raise RuntimeError("boom")
            x = block(x)
        return self.head(self.norm(x)) * self.scale

    def decode(self, x):
        """An entry point that is not forward (like a VAE's decode): only `head` runs."""
        return self.head(x)


def make(tied=False):
    torch.manual_seed(0)
    return Tiny(tied=tied).eval()


TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])
LAYOUTS = [OffloadType.BLOCK_LEVEL, OffloadType.LEAF_LEVEL]


def all_hooked(module):
    return [name for name, sub in module.named_modules() if hasattr(sub, "_hf_hook")]


@pytest.mark.parametrize("to_disk", [False, True], ids=["ram", "disk"])
@pytest.mark.parametrize("offload_type", LAYOUTS, ids=lambda t: t.value)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_outputs_equal_plain_run_twice_and_removal_restores(offload_type, to_disk, tied, tmp_path):
    model = make(tied)
    with torch.no_grad():
        expected = model(TOKENS)
    config = GroupOffloadingConfig(
        onload_device="cpu", offload_type=offload_type, offload_to_disk_path=tmp_path if to_disk else None
    )
    apply_group_offloading(model, config)
    session = group_offloading_session(model)
    with torch.no_grad():
        for _ in range(2):
            assert_same_output(model(TOKENS), expected)
            assert session.resident_groups == []
            devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
            assert devices == ({"meta"} if to_disk else {"cpu"})
    if to_disk:
        files = os.listdir(session.disk_folder)
        assert len(files) == len(session.groups) and all(f.endswith(".safetensors") for f in files)
    if tied:
        assert model.head.weight is model.embed.weight

    remove_group_offloading(model)
    assert all_hooked(model) == []
    assert {t.device.type for t in model.parameters()} == {"cpu"}
    assert not model.blocks[0][0].weight.is_pinned()
    if tied:
        assert model.head.weight is model.embed.weight
    if to_disk:
        assert os.listdir(tmp_path) == []  # the group files went with the hooks
    with torch.no_grad():
        assert_same_output(model(TOKENS), expected)


@pytest.mark.parametrize("blocks_per_group, expected", [
    (1, [["blocks.0", "rest"], ["blocks.1", "rest"], ["blocks.2", "rest"], ["blocks.3", "rest"]]),
    (2, [["blocks.0-1", "rest"], ["blocks.0-1", "rest"], ["blocks.2-3", "rest"], ["blocks.2-3", "rest"]]),
    (3, [["blocks.0-2", "rest"]] * 3 + [["blocks.3", "rest"]]),
])
def test_block_level_onloads_one_run_of_blocks_at_a_time(blocks_per_group, expected):
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu", num_blocks_per_group=blocks_per_group))
    with torch.no_grad():
        model(TOKENS)
    assert model.log == expected


def test_leaf_level_onloads_one_layer_at_a_time():
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu", offload_type="leaf_level"))
    names = [group.name for group in group_offloading_session(model).groups]
    assert names == ["root", "embed", "blocks.0.0", "blocks.1.0", "blocks.2.0", "blocks.3.0", "norm", "head"]
    with torch.no_grad():
        model(TOKENS)
    # Only the root's own buffer (`scale`) stays resident while a probe runs: each Linear went back after it ran.
    assert model.log == [["root"]] * 4


def test_prefetch_chain_onloads_the_next_group_while_the_current_one_runs(monkeypatch):
    class PrefetchingCopy(BlockingTransfer):
        prefetches = True  # what StreamTransfer does on CUDA, with a copy that completes at once

    monkeypatch.setattr(group_offload, "make_transfer", lambda device, use_stream: PrefetchingCopy())
    model = make()
    with torch.no_grad():
        expected = model(TOKENS)
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))
    with torch.no_grad():
        model(TOKENS)  # first call records the execution order
        traced = list(model.log)
        model.log.clear()
        assert_same_output(model(TOKENS), expected)
    assert traced == [["blocks.0", "rest"], ["blocks.1", "rest"], ["blocks.2", "rest"], ["blocks.3", "rest"]]
    assert model.log == [["blocks.0", "blocks.1", "rest"], ["blocks.1", "blocks.2", "rest"],
                         ["blocks.2", "blocks.3", "rest"], ["blocks.3", "rest"]]
    assert group_offloading_session(model).resident_groups == []


class MidBlock(nn.Module):
    """Runs between two block lists through a child of the rest group (like a UNet's mid block)."""

    def __init__(self):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.mid = nn.Linear(8, 8)
        self.up = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.down:
            x = block(x)
        x = self.mid(x)
        for block in self.up:
            x = block(x)
        return x


def test_prefetch_loads_each_group_once_per_call_when_the_rest_is_re_entered(monkeypatch):
    class PrefetchingCopy(BlockingTransfer):
        prefetches = True

    monkeypatch.setattr(group_offload, "make_transfer", lambda device, use_stream: PrefetchingCopy())
    torch.manual_seed(0)
    model = MidBlock().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))
    session = group_offloading_session(model)
    onloads = []
    for group in session.groups:
        original = group.onload
        group.onload = lambda original=original, group=group: original() and not onloads.append(group.name)
    with torch.no_grad():
        model(x)  # traces
        onloads.clear()
        assert_same_output(model(x), expected)
    # `mid` re-enters the rest group between the block lists: that must not prefetch down.0 a second time.
    assert onloads == ["rest", "down.0", "down.1", "up.0", "up.1"]


def test_entry_point_other_than_forward_onloads_what_it_calls(tmp_path):
    model = make()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model.decode(x)
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu", offload_to_disk_path=tmp_path))
    with torch.no_grad():
        assert_same_output(model.decode(x), expected)
    assert model.head.weight.is_meta and group_offloading_session(model).resident_groups == []


def test_a_call_that_raises_does_not_leave_groups_behind():
    model = make()
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))
    session = group_offloading_session(model)
    model.fail_in_block = 2
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(TOKENS)
    assert session.resident_groups  # the rest group was left onloaded by the failed call ...
    model.fail_in_block = None
    model.log.clear()
    with torch.no_grad():
        model(TOKENS)
    assert session.resident_groups == [] and model.log[0] == ["blocks.0", "rest"]  # ... and swept by the next


def test_applying_twice_replaces_and_accelerate_removal_undoes_everything(tmp_path):
    model = make()
    with torch.no_grad():
        expected = model(TOKENS)
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu", offload_to_disk_path=tmp_path))
    apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu", offload_type="leaf_level"))
    assert len(os.listdir(tmp_path)) == 0  # the first application's files were removed with it
    assert group_offloading_session(model).config.offload_type is OffloadType.LEAF_LEVEL
    remove_hook_from_module(model, recurse=True)
    assert all_hooked(model) == []
    assert {t.device.type for t in model.parameters()} == {"cpu"}
    with torch.no_grad():
        assert_same_output(model(TOKENS), expected)


def test_accelerate_offload_hooks_are_a_conflict():
    model = make()
    cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(OffloadConflictError, match=r"already has sequential offload.*remove_sequential_cpu_offload"
                                                   r".*reset_device_map"):
        apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))


def test_weights_on_meta_are_refused():
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(OffloadConfigError, match="meta device.*Load the weights first"):
        apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu"))
    assert all_hooked(model) == []


def test_unwritable_disk_path_fails_cleanly(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    model = make()
    with pytest.raises(OffloadConfigError, match="writable"):
        apply_group_offloading(model, GroupOffloadingConfig(onload_device="cpu", offload_to_disk_path=not_a_folder))
    assert all_hooked(model) == [] and {t.device.type for t in model.parameters()} == {"cpu"}


def test_config_defaults_and_normalisation():
    config = GroupOffloadingConfig(onload_device=0)
    assert config.onload_device.index == 0 and config.onload_device.type in ("cuda", "xpu")
    assert config.offload_device == torch.device("cpu")
    assert config.offload_type is OffloadType.BLOCK_LEVEL and config.num_blocks_per_group == 1
    leaf = GroupOffloadingConfig(onload_device="cuda:1", offload_type="leaf_level")
    assert leaf.offload_type is OffloadType.LEAF_LEVEL and leaf.onload_device.index == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(onload_device="cpu", use_stream=True), "use_stream=True.*CUDA"),
    (dict(onload_device="cpu", offload_type="layer"), "'block_level', 'leaf_level'"),
    (dict(onload_device="cpu", num_blocks_per_group=0), "num_blocks_per_group"),
    (dict(onload_device="disk"), "onload_device='disk'.*offload_to_disk_path"),
    (dict(onload_device="cpu", offload_device="meta"), "offload_device='meta'"),
])
def test_bad_configs_are_clear_errors(kwargs, message):
    with pytest.raises(OffloadConfigError, match=message):
        GroupOffloadingConfig(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only machine")
def test_cuda_onload_without_cuda_is_a_clear_error():
    model = make()
    with pytest.raises(OffloadConfigError, match="no CUDA device"):
        apply_group_offloading(model, GroupOffloadingConfig(onload_device=0))
    assert all_hooked(model) == []


def _stack(blocks: int, width: int = 1024, layers_per_block: int = 4) -> nn.Module:
    """A component whose weights dwarf its activations: `blocks` blocks of `layers_per_block` Linear layers."""
    return nn.Sequential(*[nn.Sequential(*[nn.Linear(width, width) for _ in range(layers_per_block)])
                           for _ in range(blocks)]).eval()


def _peak_of(technique: str, components, x) -> tuple[int, torch.Tensor]:
    from hooks import apply_model_cpu_offload

    if technique == "none":
        for component in components:
            component.to("cuda")
    elif technique == "model":
        apply_model_cpu_offload(components, execution_device=0)
    else:
        leaf = technique == "group-leaf-stream"
        for component in components:
            apply_group_offloading(component, GroupOffloadingConfig(
                onload_device=0, offload_type="leaf_level" if leaf else "block_level", use_stream=leaf))
    with torch.no_grad():
        for component in components:  # warm-up: traces the prefetch order
            x_warm = component(x.cuda())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = x.cuda()
        for component in components:
            out = component(out)
        torch.cuda.synchronize()
    del x_warm
    return torch.cuda.max_memory_allocated(), out.cpu()


@pytest.mark.gpu
def test_peak_memory_ordering_and_outputs_on_gpu():
    """group(leaf, stream) <= group(block) < model offload < no offload, with weights (16 MiB per block)
    dominating activations; every technique gives the plain outputs."""
    x = torch.randn(4, 1024)
    peaks, outputs = {}, {}
    for technique in ("none", "model", "group-block", "group-leaf-stream"):
        torch.manual_seed(0)
        components = [_stack(2), _stack(8), _stack(2)]
        peaks[technique], outputs[technique] = _peak_of(technique, components, x)
        for component in components:
            remove_hook_from_module(component, recurse=True)
        del components
        torch.cuda.empty_cache()
    assert peaks["group-leaf-stream"] <= peaks["group-block"] < peaks["model"] < peaks["none"], peaks
    for technique, out in outputs.items():
        torch.testing.assert_close(out, outputs["none"], atol=1e-4, rtol=1e-4, msg=technique)


@pytest.mark.gpu
@pytest.mark.parametrize("offload_type", LAYOUTS, ids=lambda t: t.value)
def test_stream_prefetch_from_ram_and_disk_on_gpu(offload_type, tmp_path):
    for path in (None, tmp_path):
        model = make()
        with torch.no_grad():
            expected = model(TOKENS)
        apply_group_offloading(model, GroupOffloadingConfig(onload_device=0, offload_type=offload_type,
                                                            use_stream=True, offload_to_disk_path=path))
        with torch.no_grad():
            for _ in range(3):  # the first call traces, the next ones prefetch
                torch.testing.assert_close(model(TOKENS).cpu(), expected, atol=1e-5, rtol=1e-4)
                assert group_offloading_session(model).resident_groups == []
                assert {p.device.type for p in model.parameters()} == {"meta" if path else "cpu"}
        remove_group_offloading(model)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert not any(p.is_pinned() for p in model.parameters())

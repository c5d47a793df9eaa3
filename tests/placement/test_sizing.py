"""Sizing: accelerate's module sizes, corrected for loading (bools, casts, fp32-kept modules, ties)."""

import pytest
import torch
from accelerate import init_empty_weights
from accelerate.utils import compute_module_sizes
from torch import nn

from placement.errors import PlacementError, PlanError
from placement.sizing import ComponentSize, SplitUnit, dtype_for, size_module


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, dim: int = 8, depth: int = 3):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.embed = nn.Embedding(16, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.act = nn.SiLU()
        self.head = nn.Linear(dim, 4)
        self.register_buffer("steps", torch.arange(10))  # int64: never cast


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_plain_model_total_at_own_dtype_and_at_bf16():
    net = Net()
    fp32 = size_module(net)
    bf16 = size_module(net, torch.bfloat16)
    assert fp32.total == 4 * _params(net) + 8 * 10
    assert bf16.total == 2 * _params(net) + 8 * 10  # the int64 buffer keeps 8 bytes per element
    assert isinstance(fp32.total, int) and all(isinstance(v, int) for v in bf16.module_sizes.values())


def test_module_sizes_equal_accelerates_where_it_is_right():
    net = Net()
    ours = size_module(net, torch.float16).module_sizes
    assert ours == dict(compute_module_sizes(net, dtype=torch.float16))


def test_meta_module_sizes_like_the_real_one():
    with init_empty_weights():
        meta = Net(dim=32, depth=4)
    assert next(meta.parameters()).is_meta
    real = Net(dim=32, depth=4)
    assert size_module(meta, torch.bfloat16).module_sizes == size_module(real, torch.bfloat16).module_sizes


def test_bool_tensor_is_one_byte_per_element_not_one_bit():
    net = Net()
    net.register_buffer("mask", torch.ones(64, dtype=torch.bool))
    size = size_module(net, torch.bfloat16)
    assert size.module_sizes["mask"] == 64
    assert compute_module_sizes(net, dtype=torch.bfloat16)["mask"] == 8  # accelerate's bit count
    assert size.total == 2 * _params(net) + 80 + 64


def test_smaller_float_is_cast_up_to_the_requested_dtype():
    net = Net().half()
    size = size_module(net, torch.float32)
    assert size.total == 4 * _params(net) + 80  # accelerate's min() would say 2 bytes per element
    assert size_module(net).total == 2 * _params(net) + 80


def test_tied_parameters_are_counted_once():
    net = Net()
    tied = Net()
    tied.head = nn.Linear(8, 16, bias=False)
    tied.head.weight = tied.embed.weight
    size = size_module(tied, torch.bfloat16)
    assert size.total == 2 * _params(tied) + 80
    assert size.total == size_module(net, torch.bfloat16).total - 2 * (8 * 4 + 4)  # the old head is gone


class KeptNet(Net):
    _keep_in_fp32_modules = ["norm"]

    def __init__(self):
        super().__init__()
        self.blocks[0].norm.register_buffer("counter", torch.zeros(4, dtype=torch.int64))


def test_keep_in_fp32_modules_stay_float32_and_their_int_buffers_stay_int():
    net = KeptNet()
    size = size_module(net, torch.bfloat16)
    norm_params = sum(p.numel() for name, p in net.named_parameters() if ".norm." in name)
    assert size.total == 2 * (_params(net) - norm_params) + 4 * norm_params + 80 + 32
    assert size.module_sizes["blocks.0.norm.counter"] == 32
    assert size_module(net).total == 4 * _params(net) + 80 + 32  # no dtype requested: nothing to keep


class TransformersLike(Net):
    """transformers' rule: `_keep_in_fp32_modules` only for fp16; `_strict` for fp16 and bf16."""

    _keep_in_fp32_modules = ["norm"]
    _keep_in_fp32_modules_strict = ["head"]


def test_transformers_keep_rules():
    net = TransformersLike()
    norm = sum(p.numel() for name, p in net.named_parameters() if ".norm." in name)
    head = _params(net.head)
    plain = _params(net)
    assert size_module(net, torch.bfloat16).total == 2 * (plain - head) + 4 * head + 80
    assert size_module(net, torch.float16).total == 2 * (plain - head - norm) + 4 * (head + norm) + 80


def test_real_transformers_model_matches_what_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, relative_attention_num_buckets=8
    )
    transformers.T5EncoderModel(config).save_pretrained(tmp_path)
    with init_empty_weights():
        meta = transformers.T5EncoderModel(config)
    meta.tie_weights()  # tying inside init_empty_weights() does not stick
    for dtype in (torch.float16, torch.bfloat16):
        loaded = transformers.T5EncoderModel.from_pretrained(tmp_path, dtype=dtype)
        real = sum(t.numel() * t.element_size() for t in [*loaded.parameters(), *loaded.buffers()])
        assert size_module(meta, dtype).total == real, dtype


def test_split_units_follow_no_split_blocks_in_module_order():
    size = size_module(Net(), torch.bfloat16)
    paths = [unit.path for unit in size.split_units]
    assert paths == ["scale", "embed", "blocks.0", "blocks.1", "blocks.2", "act", "head", "steps"]
    assert sum(unit.bytes for unit in size.split_units) == size.total
    assert size.no_split_classes == ("Block",)
    assert size.largest_unit == size.module_sizes["embed"] == 16 * 8 * 2
    assert SplitUnit(path="act", bytes=0) in size.split_units


def test_without_no_split_modules_the_blocks_of_its_block_lists_are_kept_whole():
    """A block's forward mixes its own tensors with its submodules' outputs (FLUX's `gate * ff(x)`): cut inside
    one, a split met two devices in one op (FluxControlNetModel declares no `_no_split_modules`)."""
    net = Net()
    net._no_split_modules = None
    size = size_module(net)
    assert size.no_split_classes == ("Block",) and not size.declares_no_split
    units = {unit.path for unit in size.split_units}
    assert "blocks.0" in units and "blocks.0.proj" not in units
    assert isinstance(size, ComponentSize)


def test_a_leaf_root_is_one_unit_named_by_the_empty_path():
    size = size_module(nn.Linear(4, 4))
    assert size.split_units == (SplitUnit(path="", bytes=80),)


def test_dtype_for_specs():
    assert dtype_for(None, "vae") is None
    assert dtype_for(torch.float16, "vae") is torch.float16
    assert dtype_for("bfloat16", "vae") is torch.bfloat16
    assert dtype_for("torch.float16", "vae") is torch.float16
    spec = {"vae": torch.float32, "default": torch.bfloat16}
    assert dtype_for(spec, "vae") is torch.float32
    assert dtype_for(spec, "unet") is torch.bfloat16
    assert dtype_for({"vae": torch.float32}, "unet") is None


@pytest.mark.parametrize("spec", [torch.int8, "float17", 3, {"vae": "nope", "default": torch.float16}])
def test_bad_dtype_is_a_typed_error_quoting_it(spec):
    with pytest.raises(PlanError) as info:
        dtype_for(spec, "unet")
    assert isinstance(info.value, (PlacementError, ValueError))
    assert "expected a floating torch.dtype" in str(info.value)
    with pytest.raises(PlanError, match="expected a floating torch.dtype"):
        size_module(Net(), dtype=torch.int64)


def test_bad_dict_entry_names_the_component():
    with pytest.raises(PlanError, match=r"torch_dtype\['vae'\] = 'nope'"):
        dtype_for({"vae": "nope"}, "unet")

"""estimate_activations on small modules written here: accuracy against a real run, attention, weights, dtype,
methods, errors."""

import pytest
import torch
import torch.nn.functional as F
from accelerate import cpu_offload, init_empty_weights
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from torch import nn

import placement
from placement.activations.fake_tensors import fused_attention_output
from placement.activations.estimate import measure_activations
from placement.activations.estimate import ActivationEstimateError, estimate_activations
from placement.errors import PlanError


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.out(attended)
        return x + self.mlp(x)


class TinyTransformer(nn.Module):
    def __init__(self, dim=32, heads=2, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock(dim, heads) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class TinyDecoder(nn.Module):
    """A conv decoder with a `decode` method, like a VAE's."""

    def __init__(self, channels=8):
        super().__init__()
        self.conv_in = nn.Conv2d(4, channels, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def decode(self, latents):
        return self.conv_out(F.silu(self.up(self.conv_in(latents))))


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(0)
    return TinyTransformer().eval()


@pytest.mark.parametrize("length", [64, 256, 1024])
def test_estimate_matches_a_real_run_within_ten_percent(transformer, length):
    x = torch.randn(2, length, 32)
    estimate = estimate_activations(transformer, (x,))
    measured = measure_activations(transformer, (x,))
    assert measured > 0
    assert abs(estimate - measured) <= 0.10 * measured, (estimate, measured)


def test_estimate_grows_linearly_with_sequence_length_for_fused_attention(transformer):
    small = estimate_activations(transformer, (torch.empty(1, 1024, 32, device="meta"),))
    large = estimate_activations(transformer, (torch.empty(1, 4096, 32, device="meta"),))
    # O(N * d) with flash attention: 4x the tokens is 4x the bytes, not the 16x an N x N matrix would give.
    assert 3.8 <= large / small <= 4.2


def test_attention_never_counts_the_score_matrix():
    # One head of width 8 over 8192 tokens: q, k, v and the output are 256 KiB each; the scores would be 256 MiB.
    torch.manual_seed(0)
    block = AttentionBlock(dim=8, heads=1)
    with init_empty_weights():
        block_on_meta = AttentionBlock(dim=8, heads=1)
    x = torch.empty(1, 8192, 8, device="meta")
    score_matrix_bytes = 8192 * 8192 * 4
    for module in (block, block_on_meta):
        estimate = estimate_activations(module, (x,))
        assert estimate < score_matrix_bytes / 50, estimate


def test_fused_attention_allocates_output_and_log_sum_exp_only():
    class Attend(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.empty(2, 4, 2048, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 4, 512, 64, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 4, 512, 32, device="meta", dtype=torch.bfloat16)
    inputs = (q.numel() + k.numel() + v.numel()) * 2
    output = 2 * 4 * 2048 * 32 * 2
    log_sum_exp = 2 * 4 * 2048 * 4
    assert estimate_activations(Attend(), (q, k, v)) == inputs + output + log_sum_exp


def test_fused_attention_output_shapes_follow_sdpa():
    q = torch.empty(2, 8, 10, 16, device="meta")
    kv = torch.empty(2, 2, 7, 16, device="meta")
    assert fused_attention_output(q, kv, kv, enable_gqa=True).shape == (2, 8, 10, 16)
    assert fused_attention_output(q, q[:1], q[:1]).shape == (2, 8, 10, 16)
    with pytest.raises(ValueError, match="same number"):
        fused_attention_output(q, kv[0], kv)


def test_weights_are_not_activations():
    wide = nn.Linear(2048, 2048)  # 16 MiB of weights
    x = torch.randn(1, 2048)
    assert estimate_activations(wide, (x,)) == 2 * 2048 * 4  # the input and the output, nothing else


def test_meta_module_and_inputs_give_the_real_module_estimate(transformer):
    with init_empty_weights():
        on_meta = TinyTransformer()
    real = estimate_activations(transformer, (torch.randn(2, 128, 32),))
    fake = estimate_activations(on_meta, torch.empty(2, 128, 32, device="meta"))
    assert real == fake


def test_module_is_left_untouched(transformer):
    before = {name: (tensor, tensor.device, tensor.dtype) for name, tensor in transformer.state_dict().items()}
    estimate_activations(transformer, (torch.randn(1, 16, 32),), dtype=torch.bfloat16)
    after = transformer.state_dict()
    assert before.keys() == after.keys()
    for name, (tensor, device, dtype) in before.items():
        assert after[name].device == device and after[name].dtype == dtype
        assert after[name].data_ptr() == tensor.data_ptr()


def test_dtype_halves_a_float32_estimate(transformer):
    x = torch.empty(2, 256, 32, device="meta")
    full = estimate_activations(transformer, (x,))
    half = estimate_activations(transformer, (x,), dtype=torch.bfloat16)
    # Everything halves except the float32 log-sum-exp of attention.
    assert 0.5 <= half / full <= 0.55


def test_keep_in_fp32_modules_stay_float32():
    class Mixed(nn.Module):
        _keep_in_fp32_modules = ["head"]

        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 64)
            self.head = nn.Linear(64, 64)

        def forward(self, x):
            hidden = self.body(x)
            return self.head(hidden.float())

    x = torch.empty(1, 64, device="meta")
    # input (bf16) + body output (bf16) + its fp32 copy + head output (fp32); a cast head would fail on fp32.
    assert estimate_activations(Mixed(), (x,), dtype=torch.bfloat16) == 64 * (2 + 2 + 4 + 4)


def test_transformers_keep_rule_casts_kept_modules_in_bf16():
    # transformers keeps `_keep_in_fp32_modules` in fp32 only for fp16 loads; in bf16 they are cast like the
    # rest (sizing and loading follow the same rule), so a head computing in the hidden dtype works.
    class TransformersLike(nn.Module):
        _keep_in_fp32_modules = ["head"]
        _keep_in_fp32_modules_strict = None  # the attribute that marks a transformers model

        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 64)
            self.head = nn.Linear(64, 64)

        def forward(self, x):
            return self.head(self.body(x))

    x = torch.empty(1, 64, device="meta")
    # input, body output and head output, all bf16: the head's weights were cast too.
    assert estimate_activations(TransformersLike(), (x,), dtype=torch.bfloat16) == 64 * (2 + 2 + 2)


def test_other_methods_and_kwargs():
    decoder = TinyDecoder().eval()
    latents = torch.randn(1, 4, 16, 16)
    estimate = estimate_activations(decoder, (), {"latents": latents}, method="decode")
    assert estimate == measure_activations(decoder, (), {"latents": latents}, method="decode")
    assert estimate >= 1 * 8 * 32 * 32 * 4  # the upsampled feature map is alive at the peak


def test_exported_from_the_package():
    assert placement.estimate_activations is estimate_activations


def test_unknown_method_is_a_clear_error():
    with pytest.raises(PlanError, match=r"TinyDecoder has no method 'forward'.*decode"):
        estimate_activations(TinyDecoder(), (torch.empty(1, 4, 8, 8, device="meta"),))


def test_a_call_that_cannot_run_names_the_module_and_the_inputs(transformer):
    with pytest.raises(ActivationEstimateError, match=r"TinyTransformer\.forward.*float32\[2, 16, 31\]"):
        estimate_activations(transformer, (torch.empty(2, 16, 31, device="meta"),))


def test_plain_tensor_attributes_are_wrapped_too():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.tensor(0.5)  # neither a parameter nor a buffer: stays a real CPU tensor

        def forward(self, x):
            return x * self.scale

    assert estimate_activations(Scaled(), (torch.empty(4, 16, device="meta"),)) == 2 * 4 * 16 * 4


def test_value_dependent_code_is_explained():
    class NeedsValues(nn.Module):
        def forward(self, x):
            return x * 2 if bool(x.sum() > 0) else x

    with pytest.raises(ActivationEstimateError, match="cannot run without data"):
        estimate_activations(NeedsValues(), (torch.empty(3, device="meta"),))


class RefusingHook(ModelHook):
    """A hook that fails if the estimate ever runs it (it would move fake tensors to a real device)."""

    def pre_forward(self, module, *args, **kwargs):
        raise AssertionError("the estimate ran an accelerate hook")


def test_accelerate_hooks_are_bypassed_and_restored(transformer):
    x = torch.randn(2, 64, 32)
    plain = estimate_activations(transformer, (x,))
    add_hook_to_module(transformer, RefusingHook())
    add_hook_to_module(transformer.blocks[1].mlp, RefusingHook())
    wrappers = (transformer.forward, transformer.blocks[1].mlp.forward)
    try:
        assert estimate_activations(transformer, (x,)) == plain
        assert isinstance(transformer._hf_hook, RefusingHook) and isinstance(transformer.blocks[1].mlp._hf_hook, RefusingHook)
        assert (transformer.forward, transformer.blocks[1].mlp.forward) == wrappers
    finally:
        remove_hook_from_module(transformer, recurse=True)
    assert not hasattr(transformer, "_hf_hook") and not hasattr(transformer.blocks[1].mlp, "_hf_hook")


def test_cpu_offloaded_module_is_estimated_from_its_shapes():
    torch.manual_seed(0)
    module = TinyTransformer().eval()
    x = torch.randn(1, 128, 32)
    plain = estimate_activations(module, (x,))
    cpu_offload(module, execution_device=torch.device("cpu"))
    try:
        assert module.blocks[0].qkv.weight.is_meta  # the weights live in the hooks' weights map now
        assert estimate_activations(module, (x,)) == plain
    finally:
        remove_hook_from_module(module, recurse=True)


def test_live_storage_tracker_counts_storages_once_and_releases_them():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from placement.activations.tracking import LiveStorageTracker

    with FakeTensorMode():
        weight = torch.empty(1024)  # 4 KiB, excluded
        x = torch.empty(256)  # 1 KiB, an input
        tracker = LiveStorageTracker()
        tracker.exclude([weight])
        tracker.count([x, "not a tensor"])
        with tracker:
            view = weight.view(32, 32).t()  # a view of a weight: nothing new
            doubled = x * 2  # +1 KiB
            doubled.add_(1)  # in place: nothing new
            del doubled  # -1 KiB
            y = x.repeat(4)  # +4 KiB: peak 1 + 4
    assert tracker.peak_bytes == 5 * 1024
    assert tracker.live_bytes == 5 * 1024
    del y, view
    assert tracker.live_bytes == 1024  # only the input is left

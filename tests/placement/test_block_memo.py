"""The block memo: identical blocks called with inputs seen before are replayed, and the estimate does not change:
the peak equal to the byte, the module order recorded the same, call for call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelerate import init_empty_weights
from torch import nn

import placement
from placement.activations.memo import CACHE_ENV, MEMO_ENV, _Record
from placement.activations.tracking import storage_key
from placement.unit_order import record_module_order


def with_and_without_memo(monkeypatch, module, args, kwargs=None, *, method="forward", dtype=None):
    """((peak, calls) with the memo, (peak, calls) without, how many calls were replayed): `calls` is every
    submodule call in order, as `record_module_order(every_call=True)` sees it."""
    monkeypatch.setenv(CACHE_ENV, "0")  # each estimate a run of its own
    replays = []
    replay = _Record.replay
    monkeypatch.setattr(_Record, "replay", lambda self, *a: replays.append(1) or replay(self, *a))
    results = {}
    for memo in ("1", "0"):
        monkeypatch.setenv(MEMO_ENV, memo)
        with record_module_order(module, every_call=True) as calls:
            peak = placement.estimate_activations(module, args, kwargs, method=method, dtype=dtype)
        results[memo] = (peak, list(calls))
    return results["1"], results["0"], len(replays)


def assert_same_estimate(monkeypatch, module, args, kwargs=None, *, replayed: int | None = None, **options):
    with_memo, without, replays = with_and_without_memo(monkeypatch, module, args, kwargs, **options)
    assert with_memo[0] == without[0]  # the peak, to the byte
    assert with_memo[1] == without[1]  # every submodule call, in order
    if replayed is None:
        assert replays > 0
    else:
        assert replays == replayed
    return with_memo[0]


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Chain(nn.Module):
    def __init__(self, block, depth: int = 4, **options):
        super().__init__()
        self.blocks = nn.ModuleList(block(**options) for _ in range(depth))

    def forward(self, x, *extra):
        for block in self.blocks:
            x = block(x, *extra)
        return x if isinstance(x, torch.Tensor) else x[0]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_identical_blocks_are_replayed_and_the_peak_is_the_full_runs(monkeypatch, dtype):
    chain = Chain(lambda: nn.Sequential(Attention(16), nn.GELU(), Attention(16)))
    # Blocks 1-3 whole, and in block 0 its second Attention (identical to its first, same inputs).
    assert_same_estimate(monkeypatch, chain, (torch.empty(2, 10, 16),), dtype=dtype, replayed=4)


class Passing(nn.Module):
    """Returns its input itself, a view of it, and new tensors sharing one storage (chunks of one result)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 16)

    def forward(self, x, *_):
        first, second = self.linear(x).chunk(2, dim=-1)
        return x, x[:, 1:], first, second.t() if second.dim() == 2 else second


class Returning(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Passing() for _ in range(3))

    def forward(self, x):
        kept = []
        for block in self.blocks:
            x, tail, first, second = block(x)
            kept += [tail, first, second]  # all alive to the end: the live bytes must be the full run's
        return x, kept


def test_outputs_that_alias_inputs_or_share_storage_are_rebuilt_alike(monkeypatch):
    assert_same_estimate(monkeypatch, Returning(), (torch.empty(5, 8),), replayed=2)


class Caching(nn.Module):
    """Writes into the list it is given (a causal VAE's frame cache): never replayed."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.append(self.linear(x))
        return x + cache[-1]


class Stashing(nn.Module):
    """Keeps a tensor on itself: alive after the call, besides its output. Never replayed."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        self.kept = self.linear(x)
        return x * 2


class StashingChain(Chain):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        for block in self.blocks:
            del block.kept
        return x


def test_blocks_with_side_effects_run_every_time(monkeypatch):
    cache: list = []  # it grows: no call sees the list another call saw
    assert_same_estimate(monkeypatch, Chain(Caching), (torch.empty(4, 8), cache), replayed=0)
    assert_same_estimate(monkeypatch, StashingChain(Stashing), (torch.empty(4, 8),), replayed=0)


class CausalStep(nn.Module):
    """One step of a causal loop, as a video VAE's decoder runs per frame: reads the cache its caller keeps,
    replaces each entry (the old one freed), advances the index, and returns a new tensor."""

    def __init__(self, keep_view: bool = False):
        super().__init__()
        self.first, self.second, self.keep_view = nn.Linear(8, 8), nn.Linear(8, 8), keep_view

    def forward(self, x, cache, index):
        for layer in (self.first, self.second):
            previous = cache[index[0]]
            tail = x[-2:] if self.keep_view else x[-2:].clone()  # a view of the input, or a copy
            x = layer(x if previous is None else torch.cat([previous, x])[-x.shape[0]:])
            cache[index[0]] = tail
            index[0] += 1
        return x


class CausalLoop(nn.Module):
    """Calls its step once per frame with one cache list and one index list, like AutoencoderKLWan._decode;
    `held` frames keep a reference to the cache's first entry (a replay must then not count it freed)."""

    def __init__(self, held: tuple[int, ...] = (), **options):
        super().__init__()
        self.step, self.held = CausalStep(**options), held

    def forward(self, x):
        cache, outputs, kept = [None, None], [], []
        for frame in range(x.shape[0]):
            if frame in self.held:
                kept.append(cache[0])
            outputs.append(self.step(x[frame], cache, [0]))
        return torch.cat(outputs)


@pytest.mark.parametrize("keep_view", [False, True])
def test_a_call_writing_into_its_cache_list_is_replayed_with_its_writes(monkeypatch, keep_view):
    # Frame 0 sees an empty cache, frames 1+ a full one of the same shapes: 1 + 1 runs, the rest replayed (the
    # input is a different frame of `x` each call: where a view starts is not part of the key).
    for frames in (1, 2, 3, 6):
        assert_same_estimate(monkeypatch, CausalLoop(keep_view=keep_view), (torch.empty(frames, 5, 8),),
                             replayed=max(frames - 2, 0))


def test_a_replay_that_would_free_otherwise_gives_way_to_a_full_run(monkeypatch):
    # At frame 3 the caller holds the cache entry the step replaces; the run recorded at frame 1 freed it. Frame 2
    # is replayed, frame 3's replay finds the entry alive and the estimate runs again without the memo: the peak
    # and the calls observed are the full run's.
    x = (torch.empty(6, 5, 8),)
    peak = assert_same_estimate(monkeypatch, CausalLoop(held=(3,)), x, replayed=2)
    assert peak > assert_same_estimate(monkeypatch, CausalLoop(), x, replayed=4)  # holding it costs bytes


class DictStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, cache):
        out = self.linear(x if "last" not in cache else x + cache["last"])
        cache["last"] = out[-1:].clone()
        return out


class DictLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.step = DictStep()  # a child with submodules: a candidate

    def forward(self, x):
        cache: dict = {}
        return torch.cat([self.step(x[frame], cache) for frame in range(x.shape[0])])


def test_writes_into_a_dict_are_replayed(monkeypatch):
    assert_same_estimate(monkeypatch, DictLoop(), (torch.empty(5, 4, 8),), replayed=3)


class Widening(nn.Module):
    """Same class, same parameters; a plain attribute changes what it allocates."""

    def __init__(self, copies: int):
        super().__init__()
        self.linear, self.copies = nn.Linear(8, 8), copies

    def forward(self, x):
        return self.linear(torch.cat([x] * self.copies)[: x.shape[0]])


def test_blocks_differing_in_a_plain_attribute_are_not_identical(monkeypatch):
    chain = Chain(Widening, depth=1, copies=1)
    chain.blocks.extend([Widening(5), Widening(1), Widening(5)])
    assert_same_estimate(monkeypatch, chain, (torch.empty(4, 8),), replayed=2)  # the third and the fourth


def test_a_block_with_a_forward_hook_is_run_and_its_hook_sees_every_call(monkeypatch):
    chain = Chain(Attention, dim=16)
    seen = []
    handles = [block.register_forward_hook(lambda m, a, out: seen.append(out.shape)) for block in chain.blocks]
    assert_same_estimate(monkeypatch, chain, (torch.empty(2, 10, 16),), replayed=0)
    assert len(seen) == 2 * len(chain.blocks)  # with and without the memo
    for handle in handles:
        handle.remove()


def test_the_memo_leaves_the_module_as_it_was(monkeypatch):
    chain = Chain(lambda: nn.Sequential(Attention(16)))
    assert_same_estimate(monkeypatch, chain, (torch.empty(2, 10, 16),))
    assert all("forward" not in vars(module) and not module._forward_pre_hooks for module in chain.modules())


class Rotary(nn.Module):
    """Takes its rotary tables as a tuple keyword argument, as FLUX's blocks take `image_rotary_emb`."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, *, rotary):
        cos, sin = rotary
        return self.linear(x * cos + x * sin)


class RotaryChain(Chain):
    def forward(self, x):
        rotary = (x.new_ones(8), x.new_zeros(8))
        for block in self.blocks:
            x = block(x, rotary=rotary)
        return x


def test_blocks_taking_a_tuple_keyword_are_replayed(monkeypatch):
    # The keyword arguments' dict is the call's own: what a block does to it is no write to replay.
    assert_same_estimate(monkeypatch, RotaryChain(Rotary), (torch.empty(4, 8),), replayed=3)


def test_a_storage_allocated_where_a_freed_one_was_gets_another_key():
    # A replaced cache entry and its replacement are two storages even at one address (the memo tells frees apart
    # by these keys: with addresses, recording a call depended on what ran before it in the process).
    tensor = torch.empty(4, device="meta")
    first, address = storage_key(tensor), id(tensor.untyped_storage())
    del tensor
    tensor = torch.empty(4, device="meta")
    if id(tensor.untyped_storage()) != address:
        pytest.skip("this interpreter did not reuse the freed storage's address")
    assert storage_key(tensor) != first
    assert storage_key(tensor) == storage_key(tensor[1:])  # views still share their storage's key


class _Layer:  # one layer of a KV cache, as transformers' DynamicLayer holds it
    def __init__(self) -> None:
        self.keys, self.is_initialized, self.peeked = None, False, False


class _Cache:
    def __init__(self, layers: int) -> None:
        self.layers = [_Layer() for _ in range(layers)]


class CachingBlock(nn.Module):
    """Appends its keys to its own layer of the cache (`layer_idx`); `nosy`: also marks the next layer (a plain
    write no output or storage shows) or appends its keys there too (`nosy="keys"`)."""

    def __init__(self, dim: int, layer_idx: int, nosy: str | None = None):
        super().__init__()
        self.layer_idx, self.nosy = layer_idx, nosy
        self.key, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, cache):
        following = cache.layers[(self.layer_idx + 1) % len(cache.layers)]
        for layer in [cache.layers[self.layer_idx], *([following] if self.nosy == "keys" else [])]:
            keys = self.key(x)
            layer.keys = keys if layer.keys is None else torch.cat([layer.keys, keys], dim=1)
            layer.is_initialized = True
        if self.nosy == "mark":
            following.peeked = True
        return x + self.out(cache.layers[self.layer_idx].keys[:, -x.shape[1]:])


class CachingChain(nn.Module):
    def __init__(self, nosy: str | None = None, depth: int = 4, dim: int = 32):
        super().__init__()
        self.depth = depth
        self.blocks = nn.ModuleList(CachingBlock(dim, i, nosy) for i in range(depth))

    def forward(self, x):
        cache = _Cache(self.depth)
        for block in self.blocks:
            x = block(x, cache)
        return x, [layer.keys for layer in cache.layers], [layer.peeked for layer in cache.layers]


@pytest.mark.parametrize("nosy, replayed", [(None, 3), ("mark", 0), ("keys", 0)])
def test_blocks_writing_their_own_layer_of_a_kv_cache_are_replayed_others_run(monkeypatch, nosy, replayed):
    """A block takes a KV cache (an object of `layers`) and writes the layer its `layer_idx` names: replayed, the
    replay writing the replaying block's own layer. A block that writes another layer too is never recorded."""
    with init_empty_weights():
        chain = CachingChain(nosy).eval()
    x = torch.empty(2, 16, 32, device="meta")
    assert_same_estimate(monkeypatch, chain, (x,), replayed=replayed)
    left = {}
    for memo in ("1", "0"):
        monkeypatch.setenv(MEMO_ENV, memo)
        _, keys, peeked = placement.estimate_call(chain, (x,)).output
        left[memo] = [tuple(k.shape) for k in keys], peeked
    assert left["1"] == left["0"] == ([(2, 32 if nosy == "keys" else 16, 32)] * 4, [nosy == "mark"] * 4)

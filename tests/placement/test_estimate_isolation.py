"""An estimate leaves the module as it found it, caches included, and can read its integer inputs' values.

Z-Image's rotary embedder (a plain object the transformer calls like a function) computes its frequency tables on
its first call and keeps them; estimated first, it kept fake tensors, and every real run after read them (the
placed pipeline's output was wrong everywhere). Lumina 2 sizes its positions by each caption's length, read from
its mask (`mask.sum(1).tolist()`): with `keep_values` the estimate runs it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from placement import estimate_call
from placement.activations import ActivationEstimateError


class _LazyTables:
    """Computes its table on first call and keeps it (as diffusers' rotary embedders do)."""

    def __init__(self, width: int) -> None:
        self.width, self.table, self.seen = width, None, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(self.width, dtype=x.dtype, device=x.device) / self.width
        elif self.table.device != x.device:  # kept, and moved where the input is
            self.table = self.table.to(x.device)
        self.seen.append(x.shape[0])
        return x + self.table


class LazyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.tables = _LazyTables(8)
        self.cache: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache["last"] = x
        self.note = "ran"
        return self.linear(self.tables(x))


def test_an_estimate_leaves_lazy_caches_and_attributes_as_they_were():
    torch.manual_seed(0)
    model = LazyModel()
    x = torch.randn(3, 8)
    expected = model(x)  # fills the cache with real tensors
    table, seen = model.tables.table, list(model.tables.seen)
    estimate_call(model, torch.empty(5, 8, device="meta"))
    assert model.tables.table is table and model.tables.seen == seen  # the plain object's state, its list too
    assert model.cache["last"] is x and model.note == "ran"
    fresh = LazyModel()
    fresh.load_state_dict(model.state_dict())
    estimate_call(fresh, torch.empty(5, 8, device="meta"))  # first call is the estimate's
    assert fresh.tables.table is None and not hasattr(fresh, "note") and fresh.cache == {}
    torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)  # the same module, the same input: exact


class CaptionLengths(nn.Module):
    """Sizes a tensor by the values of an integer mask, as Lumina 2's rotary positions do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        lengths = mask.sum(dim=1).tolist()
        positions = torch.zeros(hidden.shape[0], max(lengths), 4, device=hidden.device, dtype=hidden.dtype)
        return self.proj(hidden[:, : positions.shape[1]] + positions)


def test_integer_inputs_keep_their_values_when_asked():
    model = CaptionLengths()
    hidden = torch.empty(2, 10, 4, device="meta")
    mask = torch.zeros(2, 10, dtype=torch.int64)
    mask[0, :3], mask[1, :7] = 1, 1
    with pytest.raises(ActivationEstimateError, match="DataDependent|data-dependent"):
        estimate_call(model, (hidden, mask))
    estimate = estimate_call(model, (hidden, mask), keep_values=True)
    assert estimate.output.shape == (2, 7, 4) and estimate.output.is_meta  # longest caption: 7 tokens
    assert estimate.peak_bytes > 0


def test_hooks_a_model_installs_on_its_first_call_are_taken_off_with_their_flag():
    """transformers 5 installs output-capturing forward hooks on a model's layers at its first call asking for
    hidden states, and marks the model; the estimate ran that first call, and kept the hooks (a dict subclass:
    torch's hook registries are OrderedDicts) but not the mark, so the real first call installed them again and
    every hidden state was captured twice: SDXL's `hidden_states[-2]` read the wrong layer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPTextConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                         num_hidden_layers=2, vocab_size=50, max_position_embeddings=8)
    torch.manual_seed(0)
    model, twin = transformers.CLIPTextModel(config).eval(), transformers.CLIPTextModel(config).eval()
    twin.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 5, 7, 2, 0, 0, 0, 0]])
    estimate_call(model, (ids.to("meta"),), {"output_hidden_states": True})
    assert not [name for name, sub in model.named_modules() if sub._forward_hooks]
    with torch.no_grad():
        ours, theirs = model(ids, output_hidden_states=True), twin(ids, output_hidden_states=True)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 3
    torch.testing.assert_close(ours.hidden_states[-2], theirs.hidden_states[-2], rtol=0, atol=0)  # same weights

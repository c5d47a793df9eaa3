"""The estimate cache: a call estimated once is answered from memory while the module is unchanged, and estimated
again whenever anything it depends on changed (weights re-cast, a technique toggled, inputs, dtype)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import placement
from placement.activations import estimate, memo as estimate_memo
from placement.unit_order import record_module_order


class Tiling(nn.Module):
    """A decoder whose flag changes what a call allocates, as a VAE's `use_tiling` does."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(3))
        self.use_tiling = False

    def forward(self, x):
        parts = x.chunk(4) if self.use_tiling else (x,)
        outputs = []
        for part in parts:
            for block in self.blocks:
                part = block(part)
            outputs.append(part)
        return torch.cat(outputs)


@pytest.fixture
def runs(monkeypatch):
    """How many estimates really ran (not answered from memory)."""
    count = []
    run = estimate._run
    monkeypatch.setattr(estimate, "_run", lambda *a: count.append(1) or run(*a))
    monkeypatch.setenv(estimate_memo.CACHE_ENV, "1")
    return count


def test_a_repeated_call_is_answered_from_memory_with_its_own_output(runs):
    module, x = Tiling(), torch.empty(16, 8)
    first = placement.estimate_call(module, (x,), dtype=torch.bfloat16)
    second = placement.estimate_call(module, (torch.empty(16, 8, device="meta"),), dtype=torch.bfloat16)
    assert len(runs) == 1 and first.peak_bytes == second.peak_bytes > 0
    assert second.output.shape == (16, 8) and second.output.dtype == torch.bfloat16
    assert second.output is not first.output and second.output.device.type == "meta"


def test_observers_are_told_the_calls_of_an_answer_from_memory(runs):
    module, x = Tiling(), torch.empty(16, 8)
    orders = []
    for _ in range(2):
        with record_module_order(module, every_call=True) as calls:
            placement.estimate_activations(module, (x,))
        orders.append(calls)
    assert len(runs) == 1 and orders[0] == orders[1] and "blocks.2.2" in orders[0]


def test_anything_the_estimate_depends_on_changes_the_answer(runs):
    module, x = Tiling(), torch.empty(16, 8)
    peaks = [placement.estimate_activations(module, (x,))]
    module.use_tiling = True  # a technique toggled
    peaks.append(placement.estimate_activations(module, (x,)))
    module.use_tiling = False
    module.to(torch.bfloat16)  # the weights re-cast (the input follows: estimate at their dtype)
    peaks.append(placement.estimate_activations(module, (x.to(torch.bfloat16),)))
    module.blocks[1][1] = nn.ReLU()  # a submodule swapped
    peaks.append(placement.estimate_activations(module, (x.to(torch.bfloat16),)))
    peaks.append(placement.estimate_activations(module, (torch.empty(32, 8, dtype=torch.bfloat16),)))
    peaks.append(placement.estimate_activations(module, (x,), dtype=torch.float16))
    assert len(runs) == 6
    assert peaks[1] < peaks[0] and peaks[2] < peaks[0] and peaks[4] > peaks[3]
    module.use_tiling = True  # back to a state seen before: answered from memory
    module.to(torch.float32)
    module.blocks[1][1] = nn.GELU()
    assert placement.estimate_activations(module, (x,)) == peaks[1] and len(runs) == 6


def test_a_freed_module_drops_its_entries(runs):
    gc.collect()
    module = Tiling()
    placement.estimate_activations(module, (torch.empty(16, 8),))
    assert module in estimate_memo._entries
    entries, freed = len(estimate_memo._entries), weakref.ref(module)
    del module
    gc.collect()
    assert freed() is None and len(estimate_memo._entries) == entries - 1


def test_calls_with_hooks_or_opaque_inputs_and_the_switch_are_never_cached(runs, monkeypatch):
    module, x = Tiling(), torch.empty(16, 8)
    handle = module.blocks[0].register_forward_hook(lambda *_: None)  # it sees outputs: must see every call
    placement.estimate_activations(module, (x,))
    placement.estimate_activations(module, (x,))
    handle.remove()
    assert len(runs) == 2

    class Opaque:  # what a call may do with it is unknown: not a key
        pass

    class TakesAnything(nn.Linear):
        def forward(self, x, anything=None):
            return super().forward(x)

    linear = TakesAnything(8, 8)
    placement.estimate_activations(linear, (x,), {"anything": Opaque()})
    placement.estimate_activations(linear, (x,), {"anything": Opaque()})
    assert len(runs) == 4
    monkeypatch.setenv(estimate_memo.CACHE_ENV, "0")
    placement.estimate_activations(module, (x,))
    placement.estimate_activations(module, (x,))
    assert len(runs) == 6


def test_an_identical_module_gets_the_answer_of_the_first_and_a_different_one_does_not(runs):
    # Wan 2.2 A14B's two experts: one config, other weights: one estimate.
    first, twin, other = Tiling(), Tiling(), Tiling()
    other.use_tiling = True
    x = torch.empty(16, 8)
    peaks = [placement.estimate_activations(module, (x,)) for module in (first, twin, other)]
    assert len(runs) == 2 and peaks[0] == peaks[1] != peaks[2]
    with record_module_order(twin, every_call=True) as calls:
        placement.estimate_activations(twin, (x,))
    assert len(runs) == 2 and calls[:2] == ["blocks.0", "blocks.0.0"]  # its observers are told the calls
    del first
    gc.collect()
    assert placement.estimate_activations(twin, (x,)) == peaks[0] and len(runs) == 2  # kept for the twin

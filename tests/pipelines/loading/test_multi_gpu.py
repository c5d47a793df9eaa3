"""On two real CUDA devices (skipped otherwise): the load the virtual-accelerator tests check on the CPU
(whole, split over both GPUs, offloaded and disk components at once) puts the weights on cuda:0 / cuda:1 and
gives the images of a plain CPU run."""

from __future__ import annotations

import pytest
import torch

from pipelines import Pipeline

from pipeline_fixtures import generate, has_hooks, module_components, save_preset
from test_virtual_accelerators import EVERY_KIND_STRATEGY, every_kind, hook_counts

pytestmark = pytest.mark.multi_gpu


@pytest.fixture(autouse=True)
def real_accelerators(monkeypatch):
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)


def test_every_placement_kind_over_two_gpus_matches_the_cpu_run(tmp_path):
    folder, pipe = save_preset(tmp_path / "tiny-flux")
    expected = generate(pipe)
    loaded = Pipeline.from_pretrained(folder, device_map=EVERY_KIND_STRATEGY, max_memory=every_kind(folder),
                                      offload_folder=tmp_path / "offload", progress=False)
    kinds = {name: c.kind.value for name, c in loaded.placement_plan.components.items()}
    assert sorted(kinds.values()) == ["disk", "offloaded", "split", "whole"]
    split = loaded.components[next(name for name, kind in kinds.items() if kind == "split")]
    assert {p.device for p in split.parameters()} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    whole = loaded.components[next(name for name, kind in kinds.items() if kind == "whole")]
    assert hook_counts(whole) == {"MoveInputsHook": 1}
    torch.testing.assert_close(generate(loaded), expected, atol=1e-3, rtol=0)
    loaded.reset_device_map()
    assert not has_hooks(loaded)


def test_balanced_whole_components_over_two_gpus_match_the_cpu_run(tmp_path):
    folder, pipe = save_preset(tmp_path / "tiny-flux")
    expected = generate(pipe)
    loaded = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={0: "1GiB", 1: "1GiB"},
                                      progress=False)
    assert set(loaded.hf_device_map.values()) == {0, 1}
    devices = {p.device.index for m in module_components(loaded).values() for p in m.parameters()}
    assert devices == {0, 1}
    torch.testing.assert_close(generate(loaded), expected, atol=1e-3, rtol=0)

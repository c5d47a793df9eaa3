"""benchmarks/time_per_call_gpu.py end to end on one virtual accelerator at tiny sizes (the ratios are the GPU's
to check; here: it builds, loads resident and streamed, traces, and reports), and its one line without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import time_per_call  # noqa: E402
import time_per_call_gpu as bench  # noqa: E402

CALL = {"height": 64, "width": 64, "num_inference_steps": 2}


def test_without_cuda_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert capsys.readouterr().out.strip() == bench.NEEDS_GPU
    time_per_call.main(["--gpu"])
    assert capsys.readouterr().out.strip() == bench.NEEDS_GPU


def test_the_benchmark_runs_and_reports_on_a_virtual_accelerator(tmp_path, monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder = bench.build(tmp_path / "pipe", depth=(1, 3), hidden=64, heads=2)
    budgets = [("resident", {0: 4 * 1024**2 * 64, "cpu": 64 * 1024**3}),
               ("streamed", bench.streaming_budget(folder, gpu="h200", call=CALL))]
    results = bench.measure(folder, budgets=budgets, gpu="h200", call=CALL, calls=1)
    assert [r.label for r in results] == ["resident", "streamed"]
    resident, streamed = (r.plan for r in results)
    assert resident.transfer_bytes_per_call == 0 and streamed.transfer_bytes_per_call > 0
    assert resident.seconds_per_call and streamed.seconds_per_call
    assert results[1].trace is not None and results[0].trace is None
    figures = bench.trace_figures(results[1].trace)
    assert figures["copied_bytes"] > 0 and 0 <= figures["exposed_s"] <= figures["copy_s"]
    lines = bench.report(results, "h200")
    assert lines[1].startswith("resident") and lines[2].startswith("streamed")
    assert any(line.startswith("exposed copy s:") for line in lines)
    assert any(line.startswith("pinned host -> GPU:") for line in lines)
    assert lines[-1].startswith("within 20%: resident")


def test_trace_spans_union_and_overlap():
    assert bench._union([(0, 2), (1, 3), (5, 6)]) == [[0, 3], [5, 6]]
    assert bench._length(bench._intersection([[0, 3], [5, 6]], [[2, 5.5]])) == pytest.approx(1.5)

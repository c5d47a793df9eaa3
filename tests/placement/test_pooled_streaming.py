"""The planner's pooled-residency option (issue 39): a denoiser too big for two GPUs keeps resident blocks on both
and streams the rest; where copies bound the call, every other streamed block streams onto the second GPU through
its own host link and stream buffer (`ComponentTransfer.streamed_devices`), the search choosing it by predicted
seconds (`time_model.stream_links`); where compute hides the copies, nothing changes."""

from __future__ import annotations

import pytest

import placement
from placement.cost import STREAM_BUFFER_BLOCKS
from placement.devices import is_accelerator
from placement.strategies import search

from synthetic import component

LINK = 25e9
STEPS = 28
MEMORY = {0: "10GiB", 1: "10GiB", "cpu": "128GiB"}  # 24 GiB of blocks: 18 or so resident, the rest streamed


def plan(flops: int, **options):
    return placement.plan({"denoiser": component([1] * 24)}, max_memory=MEMORY, runs_per_call={"denoiser": STEPS},
                          activations={"denoiser": 0}, gpu="h100", link_bandwidth=LINK,
                          flops_per_run={"denoiser": flops}, **options)


def one_link(monkeypatch, flops: int):
    """The plan the search makes without the pooled option: every streamed block over the home GPU's link."""
    with monkeypatch.context() as patched:
        patched.setattr(search, "_onto", lambda ledger, choice: None)
        return plan(flops)


def test_copy_bound_the_blocks_stream_over_both_gpus_links_and_the_call_is_predicted_faster(monkeypatch):
    flops = 10**12  # tens of ms of compute per 24 GiB run on an H100: the copies bound the call
    pooled, single = plan(flops), one_link(monkeypatch, flops)
    denoiser, transfer = pooled.components["denoiser"], pooled.components["denoiser"].transfer
    home = denoiser.execution_device
    onto = set(transfer.streamed_devices.values())
    assert len(onto) == 1 and home not in onto and all(is_accelerator(d) for d in onto)
    # Every other streamed block, in execution order, streams onto the other GPU; the rest onto the home.
    assert list(transfer.streamed_devices) == transfer.streamed_modules[1::2]
    assert transfer.streamed_per_run_bytes > 0 and not single.components["denoiser"].transfer.streamed_devices
    assert pooled.seconds_per_call < single.seconds_per_call
    # The second buffer costs resident room: more bytes move, and the seconds paid for them.
    assert pooled.transfer_bytes_per_call >= single.transfer_bytes_per_call
    # Each GPU's phase holds its stream buffer: the plan's peaks stay within the budgets.
    block = transfer.streamed_per_run_bytes // len(transfer.streamed_modules)
    (other,) = onto
    device = next(d for d in pooled.devices if d.device == other)
    assert device.streaming_working_set >= STREAM_BUFFER_BLOCKS * block
    assert all(d.predicted_peak <= d.budget for d in pooled.devices if d.budget is not None)
    assert "streamed" in pooled.explain() or "streams" in pooled.explain()


def test_where_compute_hides_the_copies_the_plan_streams_over_one_link(monkeypatch):
    flops = 10**17  # about 100 s of compute per run: every copy hides, the bytes decide
    hidden, single = plan(flops), one_link(monkeypatch, flops)
    assert not hidden.components["denoiser"].transfer.streamed_devices
    assert hidden.transfer_bytes_per_call == single.transfer_bytes_per_call
    assert {n: c.device_map for n, c in hidden.components.items()} == {
        n: c.device_map for n, c in single.components.items()}


@pytest.mark.parametrize("memory", [{0: "10GiB", "cpu": "128GiB"}])
def test_one_gpu_has_no_second_link(memory):
    one = placement.plan({"denoiser": component([1] * 24)}, max_memory=memory, runs_per_call={"denoiser": STEPS},
                         activations={"denoiser": 0}, gpu="h100", link_bandwidth=LINK,
                         flops_per_run={"denoiser": 10**13})
    assert one.components["denoiser"].transfer.streamed_per_run_bytes > 0
    assert not one.components["denoiser"].transfer.streamed_devices

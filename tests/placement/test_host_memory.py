"""Host memory is planned: every host-homed byte once plus disk staging, what is pinned, and the cpu budget."""

from __future__ import annotations

import re

import pytest

import placement
from placement import Plan
from placement.transfers import inputs
from placement.transfers.inputs import check_disk_read_bandwidth, measure_disk_read
from placement.errors import PlanError
from placement.drawings import predicted_events
from placement.host_memory import HostMemory, budget_note
from placement.sizes import GiB
from placement.time_model import DISK_BYTES_PER_S

from synthetic import component, whole


def pipeline():
    return {"text_encoder": component([1] * 8, head=0.5), "denoiser": component([1] * 12, head=0.5),
            "vae": whole(0.5, 2)}


def offloaded_plan(**options):
    return placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, runs_per_call={"denoiser": 28},
                          **options)


def test_host_memory_counts_every_host_homed_byte_once_and_pins_only_what_moves():
    plan = offloaded_plan()
    memory = plan.host_memory
    homed = sum(c.placed_bytes.get("cpu", 0) for c in plan.components.values())
    assert memory.host_homed_bytes == homed == plan.device("cpu").weight_bytes
    assert memory.staging_bytes == 0 and memory.total_bytes == homed  # nothing is homed on disk
    moving = sum(min(c.placed_bytes.get("cpu", 0), c.transfer.loaded_per_call_bytes + c.transfer.streamed_per_run_bytes)
                 for c in plan.components.values())
    assert 0 < memory.pinned_bytes == moving <= homed
    assert memory.budget == 64 * GiB and not memory.budget_detected


def test_a_component_computing_on_the_cpu_is_host_homed_and_pins_nothing():
    with pytest.warns(UserWarning, match="degrades to 'cpu'"):
        plan = placement.plan(pipeline(), max_memory={"cpu": "64GiB"})
    assert plan.host_memory.host_homed_bytes == sum(c.bytes for c in plan.components.values())
    assert plan.host_memory.pinned_bytes == 0


def test_disk_homed_weights_count_their_staging_not_their_bytes(tmp_path):
    plan = placement.plan(pipeline(), max_memory={0: "4GiB", "cpu": "3GiB"}, offload_folder=str(tmp_path))
    disk = {name: c for name, c in plan.components.items() if c.placed_bytes.get("disk")}
    assert disk, plan.explain()
    staging = max(min(c.streamed_unit_bytes, c.placed_bytes["disk"]) for c in disk.values())
    assert plan.host_memory.staging_bytes == staging > 0
    assert plan.host_memory.host_homed_bytes == sum(c.placed_bytes.get("cpu", 0) for c in plan.components.values())
    assert plan.host_memory.total_bytes <= 3 * GiB
    assert not any("Host memory is short" in warning for warning in plan.verdict.warnings)
    # A cpu budget that holds the host-homed weights but not the staging as well: the verdict says so, with the numbers.
    short = placement.plan(pipeline(), max_memory={0: "4GiB", "cpu": "2GiB"}, offload_folder=str(tmp_path))
    assert any(re.search(r"host-homed weights .* \+ disk staging 2\.00 GiB\), .* than the cpu budget of 2\.00 GiB "
                         r"\(given\)", warning) for warning in short.verdict.warnings), short.verdict.warnings


def test_over_the_cpu_budget_the_note_gives_the_numbers_and_what_to_do():
    given = HostMemory(host_homed_bytes=3 * GiB, staging_bytes=GiB, pinned_bytes=GiB, budget=3 * GiB)
    assert re.search(r"needs 4\.00 GiB of host RAM .*1\.00 GiB more than the cpu budget of 3\.00 GiB \(given\)\. "
                     r"Give a larger max_memory\['cpu'\]", budget_note(given))
    assert "(free RAM when planning)" in budget_note(given.model_copy(update={"budget_detected": True}))
    assert budget_note(given.model_copy(update={"budget": 5 * GiB})) is None
    assert budget_note(given.model_copy(update={"budget": None})) is None


def test_host_memory_shows_in_the_verdict_and_explain_and_survives_a_json_round_trip():
    plan = offloaded_plan(disk_read_bandwidth="2GB")
    line = plan.verdict.host_memory
    assert line.startswith("Host RAM: ") and "pinned" in line and "cpu budget 64.00 GiB" in line
    assert line in plan.explain()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.host_memory == plan.host_memory
    assert (again.disk_read_bandwidth, again.disk_read_bandwidth_source) == (2e9, "given")
    resident = placement.plan(pipeline(), max_memory={0: "64GiB", "cpu": "64GiB"})
    assert resident.host_memory.total_bytes == 0 and resident.verdict.host_memory is None  # nothing to say
    data = plan.model_dump(mode="json")
    assert data["host_memory"]["host_homed_bytes"] == plan.host_memory.host_homed_bytes


def test_the_disk_read_speed_is_stated_or_assumed_and_bad_values_are_refused():
    assert offloaded_plan().disk_read_bandwidth == DISK_BYTES_PER_S
    assert offloaded_plan().disk_read_bandwidth_source == "assumed: NVMe"
    assert check_disk_read_bandwidth(5e8) == 5e8
    for bad in (0, -1, "fast", True, float("inf")):
        with pytest.raises(PlanError, match="disk_read_bandwidth="):
            check_disk_read_bandwidth(bad)


def test_the_disk_read_speed_is_measured_once_per_drive(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "_MEASURED", {})  # a load earlier in this process may have measured the drive
    path = tmp_path / "shard.bin"
    path.write_bytes(b"\0" * (4 * 2**20))
    speed, source = measure_disk_read(path)
    assert speed > 0 and source.startswith("measured: 4 MiB of shard.bin")
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * 2**20)
    assert measure_disk_read(other) == (speed, source)  # the same drive: measured once
    with pytest.raises(PlanError, match="Cannot measure the disk read speed"):
        measure_disk_read(tmp_path / "missing")


def test_the_verdict_and_the_timeline_copy_disk_homed_weights_at_the_plans_disk_speed(tmp_path):
    # Both quote the speed `seconds_per_call` uses (the plan's disk_read_bandwidth), not the assumed NVMe one.
    def disk_plan(speed):
        return placement.plan(pipeline(), max_memory={0: "4GiB", "cpu": "3GiB"}, offload_folder=str(tmp_path),
                              runs_per_call={"denoiser": 28}, disk_read_bandwidth=speed)

    slow, fast = disk_plan("1GB"), disk_plan("2GB")
    disk = [c for c in slow.components.values() if c.kind.value == "disk"]
    assert disk, slow.explain()
    for component in disk:
        quoted = [w for w in slow.verdict.warnings if w.startswith(f"{component.name} ")]
        assert quoted and f"about {component.transfer.bytes_per_call / 1e9:.1f} s." in quoted[0], quoted
    ends = [max(event.time_us for event in predicted_events(plan)) for plan in (slow, fast)]
    assert ends[0] > ends[1]  # half the disk speed: the disk-homed copies take longer on the timeline

"""The transfer model (issue 18): runs per call, resident / loaded-per-call / streamed bytes, the per-phase memory
model, and the objective (nothing on the CPU if avoidable, then the fewest bytes moved per call)."""

from __future__ import annotations

import pytest

import placement
from placement import PlacementKind, Plan
from placement.plan_schema import SCHEMA_VERSION
from placement.sizes import GiB
from placement.transfers import inputs

from synthetic import component, whole

ACTIVATIONS = {"text_encoder": GiB // 4, "denoiser": GiB, "vae": 2 * GiB}


def pipeline(encoder=8, denoiser=12, vae=0.5):
    """A text encoder and a denoiser of 1 GiB blocks with a 0.5 GiB rest each, and a small VAE."""
    return {"text_encoder": component([1] * encoder, head=0.5), "denoiser": component([1] * denoiser, head=0.5),
            "vae": whole(vae, 2)}


def test_a_run_once_encoder_gives_up_its_room_to_the_denoiser_that_runs_every_step():
    # 24 GiB: the denoiser (12.5) and the encoder (8.5) fit together, but not with the VAE's 2 GiB decode
    # beside them. The encoder runs once: it streams (8.5 GiB per call); the denoiser stays whole.
    plan = placement.plan(pipeline(), max_memory={0: "22GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    denoiser, encoder = plan.components["denoiser"], plan.components["text_encoder"]
    assert denoiser.kind is PlacementKind.WHOLE and denoiser.transfer.bytes_per_call == 0
    assert encoder.execution_device == 0 and encoder.transfer.resident_bytes < encoder.bytes
    assert plan.transfer_bytes_per_call == encoder.transfer.bytes_per_call + plan.components["vae"].transfer.bytes_per_call
    assert plan.transfer_bytes_per_call <= 8.5 * GiB + 0.5 * GiB
    # Without runs_per_call every component runs once: the plan keeps as many bytes resident as it can.
    flat = placement.plan(pipeline(), max_memory={0: "22GiB", "cpu": "64GiB"}, activations=ACTIVATIONS)
    assert flat.transfer_bytes_per_call <= plan.transfer_bytes_per_call


def test_a_denoiser_that_cannot_stay_whole_keeps_what_the_other_phases_allow():
    # 12 GiB, 1 GiB overhead: the encoder's phase needs 0.25 GiB of activations and 2.5 GiB (its rest and two
    # blocks in flight), so 8.25 GiB can stay resident: the VAE (0.5) and 7.5 GiB of the denoiser (its rest
    # and 7 blocks). In its own phase its 1 GiB of activations and two blocks in flight fit beside them.
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    denoiser = plan.components["denoiser"]
    transfer = denoiser.transfer
    assert denoiser.kind is PlacementKind.OFFLOADED and denoiser.execution_device == 0
    assert transfer.resident_bytes == 7.5 * GiB
    assert transfer.streamed_per_run_bytes == 5 * GiB and transfer.loaded_per_call_bytes == 0
    assert transfer.stream_buffer_bytes == 2 * GiB and denoiser.streamed_unit_bytes == 2 * GiB
    assert plan.components["text_encoder"].transfer.resident_bytes <= GiB // 2  # runs once: its rest at most
    assert plan.transfer_bytes_per_call == 28 * 5 * GiB + 8.5 * GiB + 0.5 * GiB - GiB // 2
    keys = denoiser.device_map
    assert all(keys[key] == "cpu" for key in transfer.streamed_modules if key in keys)
    assert set(transfer.streamed_modules) == {k for k, d in keys.items() if d == "cpu"}


def test_what_does_not_fit_is_loaded_per_call_when_the_phase_has_room():
    # The denoiser's phase has room for more than its blocks in flight: that much loads once per call and
    # stays through its 28 runs; only the remainder streams at every run.
    comps = {"te": component([1, 1], head=0.5), "den": component([1] * 6, head=0.5)}
    plan = placement.plan(comps, max_memory={0: "8GiB", "cpu": "64GiB"}, activations={"te": 3 * GiB, "den": 0},
                          runs_per_call={"den": 28})
    transfer = plan.components["den"].transfer
    assert transfer.loaded_per_call_bytes > 0 and transfer.streamed_per_run_bytes == 0
    assert transfer.bytes_per_call == transfer.loaded_per_call_bytes  # nothing per run
    assert plan.device(0).phases["den"] == transfer.loaded_per_call_bytes  # no activations, nothing in flight
    assert plan.device(0).predicted_peak <= 8 * GiB


def test_a_block_loaded_per_call_onto_another_gpu_counts_there_not_on_the_execution_device():
    # c0 runs twice on GPU 1, whose 1 GiB of room holds only its two largest blocks in flight; GPU 0 has room for one
    # more block, loaded there once per call. GPU 1's working set is the blocks in flight, GPU 0's that block.
    unit = GiB // 4
    comps = {"c0": component([1, 1, 1, 3], unit=unit), "c1": component([1], head=1, unit=unit),
             "c2": component([1], head=1, unit=unit), "c3": component([2, 3], unit=unit)}
    plan = placement.plan(comps, max_memory={0: 5 * unit, 1: 8 * unit, "cpu": "250GiB"},
                          activations=dict.fromkeys(comps, 0), runs_per_call={"c0": 2})
    c0 = plan.components["c0"]
    transfer = c0.transfer
    assert c0.execution_device == 1 and transfer.per_call_devices == {"blocks.2": 0}
    assert transfer.loaded_per_call_bytes == unit and transfer.stream_buffer_bytes == 4 * unit
    assert c0.streamed_unit_bytes == transfer.stream_buffer_bytes  # nothing it loads per call is on GPU 1
    assert plan.device(0).phases["c0"] == unit
    assert (plan.device(0).loaded_per_call, plan.device(1).loaded_per_call) == (unit, 0)
    assert plan.device(1).streaming_working_set == 4 * unit


def test_two_gpus_a_resident_split_beats_streaming():
    # The denoiser (16.5 GiB) fits on neither 12 GiB GPU; split over both it stays resident, and the
    # encoder, which runs once, streams into what is left: 8.5 GiB per call instead of 28 x the denoiser.
    plan = placement.plan(pipeline(denoiser=16), max_memory={0: "12GiB", 1: "12GiB", "cpu": "64GiB"},
                          activations={"text_encoder": 0, "denoiser": GiB // 2, "vae": GiB // 2},
                          runs_per_call={"denoiser": 28})
    denoiser = plan.components["denoiser"]
    assert denoiser.kind is PlacementKind.SPLIT and denoiser.transfer.bytes_per_call == 0
    assert set(denoiser.devices) == {0, 1}
    assert plan.transfer_bytes_per_call <= 9 * GiB
    for device in plan.devices:
        assert device.left is None or device.left >= 0


def test_every_phase_fits_and_the_peak_is_the_largest_phase():
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    gpu = plan.device(0)
    assert set(gpu.phases) == {"text_encoder", "denoiser", "vae"}
    assert all(peak <= gpu.budget for peak in gpu.phase_peaks.values())
    assert gpu.predicted_peak == max(gpu.phase_peaks.values())
    assert gpu.peak_phase == max(gpu.phase_peaks, key=gpu.phase_peaks.get)
    # In the denoiser's phase: everyone's resident weights, its activations and blocks in flight, the overhead.
    denoiser = plan.components["denoiser"]
    assert gpu.phase_peaks["denoiser"] == gpu.weight_bytes + GiB + denoiser.streamed_unit_bytes + gpu.overhead
    # The vocabulary of the peak phase adds up.
    assert gpu.activation_peak == (gpu.activations or 0) + gpu.streaming_working_set
    assert gpu.loaded_per_call <= gpu.streaming_working_set


def test_when_everything_fits_resident_nothing_moves():
    plan = placement.plan(pipeline(), max_memory={0: "48GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    assert plan.transfer_bytes_per_call == 0 and plan.transfer_seconds_per_call == 0
    assert all(c.transfer.resident_bytes == c.bytes for c in plan.components.values())
    assert all(c.kind is PlacementKind.WHOLE for c in plan.components.values())
    same = placement.plan(pipeline(), max_memory={0: "48GiB", "cpu": "64GiB"}, activations=ACTIVATIONS)
    assert same.device_map == plan.device_map


def test_sequential_and_pinned_plans_get_transfer_numbers():
    comps = pipeline()
    plan = placement.plan(comps, max_memory={0: "12GiB", "cpu": "64GiB"}, strategy="sequential",
                          runs_per_call={"denoiser": 10})
    assert all(c.transfer is not None for c in plan.components.values())
    assert plan.transfer_bytes_per_call == sum(c.transfer.bytes_per_call for c in plan.components.values())
    pinned = placement.plan(comps, max_memory={0: "24GiB", "cpu": "64GiB"},
                            strategy={"denoiser": {"": "cpu", "blocks.0": 0, "head": 0}}, runs_per_call={"denoiser": 10})
    denoiser = pinned.components["denoiser"]
    assert denoiser.pinned and denoiser.execution_device == 0
    assert denoiser.transfer.resident_bytes == 1.5 * GiB
    assert denoiser.transfer.loaded_per_call_bytes + denoiser.transfer.streamed_per_run_bytes == 11 * GiB
    model = placement.plan({"denoiser": comps["denoiser"]}, max_memory={0: "6GiB", "cpu": "64GiB"}, strategy="auto",
                           scope="model", runs_per_call={"denoiser": 10})
    transfer = model.components["denoiser"].transfer  # accelerate's map: part on GPU 0, the rest in RAM
    assert transfer.resident_bytes == model.components["denoiser"].placed_bytes[0]
    assert transfer.loaded_per_call_bytes + transfer.streamed_per_run_bytes == model.components["denoiser"].placed_bytes["cpu"]
    cpu = placement.plan(comps, max_memory={0: "24GiB", "cpu": "64GiB"}, strategy="cpu")
    assert cpu.transfer_bytes_per_call == 0 and all(c.transfer.resident_bytes == 0 for c in cpu.components.values())


@pytest.mark.parametrize("runs, match", [
    ({"nope": 3}, r"runs_per_call names components that do not exist: \['nope'\]"),
    ({"denoiser": 0}, r"ints >= 1 .* got \{'denoiser': 0\}"),
    ({"denoiser": 2.5}, r"ints >= 1"),
    ({"denoiser": True}, r"ints >= 1"),
    ([("denoiser", 3)], r"runs_per_call must be a dict"),
])
def test_bad_runs_per_call_is_a_clear_error(runs, match):
    with pytest.raises(placement.PlanError, match=match):
        placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, runs_per_call=runs)


def test_link_bandwidth_is_stated_and_turns_bytes_into_seconds(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")  # no GPU to measure, on any machine: assumed
    kwargs = dict(max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS, runs_per_call={"denoiser": 28})
    assumed = placement.plan(pipeline(), **kwargs)
    assert (assumed.link_bandwidth, assumed.link_bandwidth_source) == (25e9, "assumed: PCIe 4.0 x16")
    assert assumed.transfer_seconds_per_call == pytest.approx(assumed.transfer_bytes_per_call / 25e9)
    measured = placement.plan(pipeline(), link_bandwidth="12.5GB", **kwargs)
    assert (measured.link_bandwidth, measured.link_bandwidth_source) == (12.5e9, "given")
    assert measured.transfer_seconds_per_call == pytest.approx(2 * assumed.transfer_seconds_per_call)
    assert measured.inputs.link_bandwidth == 12.5e9 and measured.inputs.runs_per_call == {"denoiser": 28}
    for bad in (0, -1, "fast", True):
        with pytest.raises(placement.PlanError, match="link_bandwidth"):
            placement.plan(pipeline(), link_bandwidth=bad, **kwargs)


def test_the_transfer_survives_a_json_round_trip_and_old_files_load_without_it():
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan and again.transfer_bytes_per_call == plan.transfer_bytes_per_call
    assert again.components["denoiser"].transfer == plan.components["denoiser"].transfer
    assert '"transfer_bytes_per_call"' in text and f'"schema_version": {SCHEMA_VERSION}' in text
    import json

    old = json.loads(text)
    old["schema_version"] = 2
    for name in old["components"]:
        old["components"][name].pop("transfer")
    for device in old["devices"]:
        for key in ("phases", "loaded_per_call"):
            device.pop(key)
    for key in ("link_bandwidth", "link_bandwidth_source", "transfer_bytes_per_call", "transfer_seconds_per_call"):
        old.pop(key)
    loaded = Plan.from_json(json.dumps(old))
    assert loaded.transfer_bytes_per_call is None and loaded.components["denoiser"].transfer is None
    assert "Moved per call" not in loaded.explain()
    loaded.to_svg()


def test_explain_the_verdict_and_the_svg_show_the_bytes_and_time_per_call():
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    from placement.sizes import format_bytes

    total = format_bytes(plan.transfer_bytes_per_call)
    text = plan.explain()
    assert "Moved per call, host -> accelerator, steady state (time at 25 GB/s, assumed: PCIe 4.0 x16):" in text
    denoiser = plan.components["denoiser"].transfer
    row = next(line for line in text.splitlines() if line.startswith("denoiser ") and " 28 " in line)
    assert format_bytes(denoiser.bytes_per_call) in row and format_bytes(denoiser.streamed_per_run_bytes) in row
    assert any(line.startswith("total") and total in line for line in text.splitlines())
    warning = next(w for w in plan.verdict.warnings if w.startswith("denoiser keeps"))
    assert "at each of its 28 runs" in warning and f"{format_bytes(denoiser.bytes_per_call)} per call" in warning
    assert plan.verdict.warnings[-1].startswith(f"Per call, {total} cross from host memory")
    svg = plan.to_svg()
    assert f"Moved per call, host -&gt; accelerator: {total}" in svg
    assert f"{format_bytes(denoiser.bytes_per_call)} per call" in svg


def test_without_a_cuda_gpu_the_link_is_assumed_and_nothing_is_measured(monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    monkeypatch.setattr(inputs, "measure_cuda_link", lambda index: pytest.fail("measured a virtual GPU"))
    plan = placement.plan(pipeline(), max_memory={0: "12GiB", 1: "4GiB", "cpu": "64GiB"}, activations=ACTIVATIONS,
                          runs_per_call={"denoiser": 28})
    assert plan.transfer_bytes_per_call > 0
    assert (plan.link_bandwidth, plan.link_bandwidth_source) == (25e9, "assumed: PCIe 4.0 x16")
    assert inputs.link_speed([0, 1], moves=True) is None  # virtual accelerators are CPUs: nothing to time


@pytest.mark.gpu
def test_on_a_cuda_gpu_the_link_is_measured_by_a_pinned_copy(monkeypatch):
    monkeypatch.delenv("PLACEMENT_VIRTUAL_ACCELERATORS", raising=False)
    measured = inputs.measure_cuda_link(0)
    assert measured is not None and 1e8 < measured < 1e12  # 0.1 GB/s .. 1 TB/s: a copy was timed
    kwargs = dict(max_memory={0: "12GiB", "cpu": "64GiB"}, activations=ACTIVATIONS, runs_per_call={"denoiser": 28})
    plan = placement.plan(pipeline(), **kwargs)
    assert plan.transfer_bytes_per_call > 0
    assert plan.link_bandwidth == measured and plan.link_bandwidth_source.startswith("measured: pinned host -> cuda:0")
    assert plan.transfer_seconds_per_call == pytest.approx(plan.transfer_bytes_per_call / measured)
    assert placement.plan(pipeline(), link_bandwidth="12.5GB", **kwargs).link_bandwidth_source == "given"
    fits = placement.plan(pipeline(), max_memory={0: "200GiB", "cpu": "64GiB"}, activations=ACTIVATIONS)
    assert fits.transfer_bytes_per_call == 0 and fits.link_bandwidth_source.startswith("assumed")  # nothing moves

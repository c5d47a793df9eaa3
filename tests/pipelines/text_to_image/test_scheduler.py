"""FlowMatchEulerScheduler: the schedule, exact Euler integration, shift, save/load, typed errors."""

from __future__ import annotations

import json

import pytest
import torch

from pipelines.errors import CallError, FolderError
from pipelines.text_to_image.schedulers import FlowMatchEulerScheduler
from same_output import assert_same_output


def test_schedule_runs_from_pure_noise_to_zero():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(10)
    sigmas, timesteps = scheduler.sigmas, scheduler.timesteps
    assert len(timesteps) == 10 and len(sigmas) == 11
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas[1:] < sigmas[:-1]).all()
    assert_same_output(timesteps, sigmas[:-1] * 1000)
    assert sigmas[-2] == pytest.approx(1 / 1000)


def test_integrating_the_true_velocity_lands_exactly_on_the_data():
    """On the straight path x_s = (1-s) x0 + s noise the velocity is noise - x0 at every s, so the Euler
    steps (summing to -1 * velocity) must end at x0 whatever the number of steps and the shift."""
    generator = torch.Generator().manual_seed(0)
    data, noise = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    for steps, shift in ((1, 1.0), (7, 1.0), (20, 3.0)):
        scheduler = FlowMatchEulerScheduler(shift=shift)
        scheduler.set_timesteps(steps)
        sample = noise.clone()
        for timestep in scheduler.timesteps:
            assert_same_output(sample, scheduler.scale_noise(data, timestep, noise))
            sample = scheduler.step(noise - data, timestep, sample)
        assert_same_output(sample, data)


def test_shift_spends_more_steps_at_high_noise():
    plain, shifted = FlowMatchEulerScheduler(), FlowMatchEulerScheduler(shift=3.0)
    plain.set_timesteps(8)
    shifted.set_timesteps(8)
    s = plain.sigmas[:-1]
    assert_same_output(shifted.sigmas[:-1], 3 * s / (1 + 2 * s))
    assert (shifted.sigmas[1:-1] > plain.sigmas[1:-1]).all()


def test_step_keeps_the_sample_dtype_and_device():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(4)
    sample = torch.randn(1, 4, 2, 2, dtype=torch.float16)
    out = scheduler.step(torch.randn(1, 4, 2, 2), scheduler.timesteps[0], sample)
    assert out.dtype == torch.float16 and out.device == sample.device
    # a timestep that went through float16 (as a pipeline might cast it) is still found
    assert scheduler.index_for_timestep(scheduler.timesteps[1].half()) == 1


def test_save_and_load_round_trip(tmp_path):
    scheduler = FlowMatchEulerScheduler(num_train_timesteps=500, shift=2.5)
    path = scheduler.save_pretrained(tmp_path / "scheduler")
    assert path.name == "scheduler_config.json"
    content = json.loads(path.read_text())
    assert content == {"_class_name": "FlowMatchEulerScheduler", "num_train_timesteps": 500, "shift": 2.5}
    loaded = FlowMatchEulerScheduler.from_pretrained(tmp_path / "scheduler")
    assert loaded.config == scheduler.config
    assert FlowMatchEulerScheduler.from_pretrained(tmp_path, subfolder="scheduler").config == scheduler.config


def test_using_the_schedule_before_set_timesteps_is_an_error():
    scheduler = FlowMatchEulerScheduler()
    with pytest.raises(CallError, match="set_timesteps"):
        scheduler.timesteps
    with pytest.raises(CallError, match="set_timesteps"):
        scheduler.step(torch.zeros(1), 1000.0, torch.zeros(1))


def test_a_timestep_outside_the_schedule_is_an_error():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(4)
    with pytest.raises(CallError, match="not in this schedule"):
        scheduler.step(torch.zeros(1), 123.0, torch.zeros(1))


def test_mismatched_shapes_are_an_error():
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(4)
    with pytest.raises(CallError, match=r"\(1, 2\)"):
        scheduler.step(torch.zeros(1, 2), scheduler.timesteps[0], torch.zeros(1, 3))


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, "10"])
def test_bad_step_counts_are_refused(steps):
    with pytest.raises(CallError, match="num_inference_steps"):
        FlowMatchEulerScheduler().set_timesteps(steps)


@pytest.mark.parametrize("fields, name", [({"shift": 0}, "shift"), ({"num_train_timesteps": -1}, "num_train_timesteps"),
                                          ({"beta_start": 0.1}, "beta_start")])
def test_bad_settings_name_the_field(fields, name):
    with pytest.raises(CallError, match=name):
        FlowMatchEulerScheduler(**fields)


def test_bad_config_files_name_the_file_and_the_field(tmp_path):
    with pytest.raises(FolderError, match="No scheduler_config.json"):
        FlowMatchEulerScheduler.from_pretrained(tmp_path)
    (tmp_path / "scheduler_config.json").write_text("{not json")
    with pytest.raises(FolderError, match="not valid JSON"):
        FlowMatchEulerScheduler.from_pretrained(tmp_path)
    (tmp_path / "scheduler_config.json").write_text(json.dumps({"shift": -2}))
    with pytest.raises(FolderError, match="'shift'"):
        FlowMatchEulerScheduler.from_pretrained(tmp_path)
    (tmp_path / "scheduler_config.json").write_text(json.dumps({"use_karras": True}))
    with pytest.raises(FolderError, match="unknown field 'use_karras'"):
        FlowMatchEulerScheduler.from_pretrained(tmp_path)

"""Placed any way, every e2e class lives a whole life equal to diffusers': for each placement kind the planner makes
of some budget (whole, split, loaded per call, streamed, CPU, disk; `placement_sweep.reach`), the pipeline loaded
so on two strict virtual GPUs runs as diffusers' plain load of the same folder runs, takes a LoRA into its denoiser
(load, fuse, unfuse, unload: each output as diffusers gives it with the same LoRA), resets clean, saves, and the
saved folder loads in diffusers with the same output. A kind no budget reaches carries the planner's own reason.

The default suite sweeps two classes (`DEFAULT_CLASSES`); `--run-slow` sweeps every class of the e2e cases."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cases import CASES
from pipelines import Pipeline
from placement_sweep import KINDS, Reach, denoiser_attribute, has_hooks, kind_of, make_lora, reach, takes_lora
from same_output import assert_same_output
from test_e2e_diffusers import run, saved, two_virtual_gpus  # noqa: F401 (fixtures)

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
from hooks.errors import OffloadConflictError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
# For the default suite, a UNet with a ControlNet and a video transformer with a parameter at its root (LTX's
# scale_shift_table, which a per-call plan lists by its own path); every class under --run-slow (about 20 minutes
# on 2 cores). FLUX on one GPU with a LoRA at every budget: test_tied_weights_placed.py.
DEFAULT_CLASSES = ("StableDiffusionControlNetPipeline", "LTXPipeline")


def cells() -> list:
    return [pytest.param(case, kind, id=f"{case.name}-{kind}",
                         marks=() if case.name in DEFAULT_CLASSES else (pytest.mark.slow,))
            for case in CASES for kind in KINDS]


@dataclass
class Swept:
    """A class' folder, diffusers' outputs without and with a LoRA of its denoiser, and where each kind is."""

    folder: Path
    expected: torch.Tensor
    lora: Path | None
    with_lora: torch.Tensor | None
    kinds: dict[str, Reach]
    offload: Path


@pytest.fixture(scope="session")
def sweeps() -> dict:
    return {}


@pytest.fixture
def swept(sweeps, saved, tmp_path_factory, two_virtual_gpus):  # noqa: F811 (fixture used by name)
    """Each class swept once per session, after the virtual GPUs and diffusers' stand-ins are in place."""

    def get(case) -> Swept:
        if case.name not in sweeps:
            folder, root = saved(case), tmp_path_factory.mktemp("sweep")
            reference = getattr(diffusers, case.name.split(" ")[0]).from_pretrained(folder, **case.load)
            expected, lora, with_lora = run(reference, case), None, None
            if takes_lora(reference):
                lora = root / "lora"
                make_lora(lora, reference)
                reference.load_lora_weights(lora, adapter_name="a")
                with_lora = run(reference, case)
            sweeps[case.name] = Swept(folder, expected, lora, with_lora, reach(folder, case, root / "offload"),
                                      root / "offload")
        return sweeps[case.name]

    return get


def adapt_fuse_and_unload(pipe, case, swept: Swept) -> None:
    """A LoRA into the placed denoiser: loaded, fused (refused only where an adapted layer's weights are on disk),
    unfused and unloaded, each output as diffusers' with the same LoRA, and the plain output back at the end."""
    pipe.load_lora_weights(swept.lora, adapter_name="a")
    assert_same_output(run(pipe, case), swept.with_lora)
    denoiser = denoiser_attribute(pipe)
    try:  # only the denoiser holds the LoRA (AuraFlow's own default would name a text encoder it cannot fuse)
        pipe.fuse_lora(components=[denoiser])
    except OffloadConflictError as refusal:
        assert "disk" in pipe.placement_plan.components[denoiser].devices and "on disk" in str(refusal)
    else:
        assert_same_output(run(pipe, case), swept.with_lora)
        pipe.unfuse_lora(components=[denoiser])
    pipe.unload_lora_weights()
    assert_same_output(run(pipe, case), swept.expected)


@pytest.mark.parametrize(("case", "kind"), cells())
def test_every_placement_kind_lives_a_whole_life_equal_to_diffusers(swept, case, kind, tmp_path):
    sweep = swept(case)
    cell = sweep.kinds[kind]
    if cell.component is None:  # not reachable: the planner says why at the budget meant for it
        assert cell.why.startswith(("at ", "refused at ")) and ": " in cell.why, cell.why
        return
    pipe = Pipeline.from_pretrained(sweep.folder, device_map="balanced", max_memory=cell.max_memory,
                                    call=case.planning_call,
                                    offload_folder=sweep.offload, progress=False, **case.load)
    assert kind_of(pipe.placement_plan.components[cell.component]) == kind
    assert_same_output(run(pipe, case), sweep.expected)
    if sweep.lora is not None:
        adapt_fuse_and_unload(pipe, case, sweep)
    pipe.reset_device_map()
    assert pipe.hf_device_map is None and not has_hooks(pipe)
    pipe.save_pretrained(tmp_path / "saved")
    reloaded = type(pipe).from_pretrained(tmp_path / "saved", **case.load)
    assert_same_output(run(reloaded, case), sweep.expected)

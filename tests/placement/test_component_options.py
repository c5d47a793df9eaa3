"""The planner owns its choices (issue 40): memory techniques that shrink a component's activations are chosen by
the one `placement.plan` call (the plan without them first, then each technique set in the caller's order, the
best outcome kept and recorded with why), and placements a component's format cannot run in are never proposed
(the search keeps it on the accelerators and moves another, or says which format refuses what)."""

import pytest

import placement
from placement import ACCELERATOR_RUNTIME_OVERHEAD as OVERHEAD
from placement import DoesNotFitError, FormatLimit, PlacementKind, TechniqueChoices
from placement.plan_schema import MemoryTechnique, VerdictKind
from placement.sizes import GiB
from synthetic import whole

TILING, SLICING = MemoryTechnique.VAE_TILING, MemoryTechnique.VAE_SLICING
COMPONENTS = {"denoiser": whole(4, 4), "vae": whole(1)}
# GPU 0 holds every weight and 2 GiB of activations: the denoiser's 1 GiB, not the VAE's 3 GiB decoded whole.
ONE_GPU = {0: 5 * GiB + 2 * GiB + OVERHEAD, "cpu": 64 * GiB}
ACTIVATIONS = {"denoiser": GiB, "vae": 3 * GiB}


class Peaks:
    """The VAE's peak per technique set, counting which sets the planner asked for (estimated lazily)."""

    def __init__(self):
        self.asked = []

    def __call__(self, name, techniques):
        self.asked.append((name, frozenset(techniques)))
        return {frozenset({SLICING}): 3 * GiB, frozenset({TILING}): GiB // 2}.get(frozenset(techniques), GiB // 4)


def choices(peaks, **options):
    sets = [{"vae": frozenset({SLICING})}, {"vae": frozenset({TILING})}, {"vae": frozenset({SLICING, TILING})}]
    return TechniqueChoices(candidates=sets, peak=peaks, details={"vae": {TILING: "tiles of 16x16 pixels"}}, **options)


def test_a_decode_that_does_not_fit_is_planned_with_the_first_technique_that_fits():
    peaks = Peaks()
    plan = placement.plan(COMPONENTS, max_memory=ONE_GPU, activations=ACTIVATIONS, techniques=choices(peaks))
    vae = plan.components["vae"]
    assert plan.verdict.kind is VerdictKind.FITS and vae.execution_device == 0
    (used,) = vae.memory_techniques
    assert used.technique is TILING and used.activation_bytes_without == 3 * GiB
    assert vae.activation_bytes == GiB // 2
    assert used.reason == ("for this call its activations are 3.00 GiB decoded whole and 512.00 MiB tiled (tiles of "
                           "16x16 pixels); decoded whole, the plan fits with offloading (denoiser offloaded). Forbid "
                           "it with call={'vae_tiling': False}.")
    # Slicing saved nothing here, so tiling was tried next; it fit, so both together were never estimated.
    assert peaks.asked == [("vae", frozenset({SLICING})), ("vae", frozenset({TILING}))]


def test_nothing_is_turned_on_when_the_plan_fits_without():
    peaks = Peaks()
    plan = placement.plan(COMPONENTS, max_memory={**ONE_GPU, 0: 10 * GiB}, activations=ACTIVATIONS,
                          techniques=choices(peaks))
    assert not plan.components["vae"].memory_techniques and peaks.asked == []


def test_a_forced_technique_is_recorded_with_its_reason():
    plan = placement.plan(COMPONENTS, max_memory={**ONE_GPU, 0: 10 * GiB}, activations={**ACTIVATIONS, "vae": GiB},
                          techniques=choices(Peaks(), forced={"vae": frozenset({TILING})},
                                             forced_reasons={"vae": {TILING: "asked for in call= (vae_tiling=True)"}}))
    (used,) = plan.components["vae"].memory_techniques
    assert used.reason == "asked for in call= (vae_tiling=True); its activations for this call are 1.00 GiB."
    assert used.activation_bytes_without is None


def test_without_a_fitting_technique_the_plan_is_the_best_outcome_or_the_first_error():
    nothing_helps = TechniqueChoices(candidates=[{"vae": frozenset({TILING})}], peak=lambda name, used: 3 * GiB)
    plan = placement.plan(COMPONENTS, max_memory=ONE_GPU, activations=ACTIVATIONS, techniques=nothing_helps)
    assert plan.verdict.kind is VerdictKind.OFFLOADED and not plan.components["vae"].memory_techniques
    with pytest.raises(DoesNotFitError, match="^denoiser needs 4.00 GiB"):  # the error of the plan without techniques
        placement.plan(COMPONENTS, max_memory={0: 2 * GiB + OVERHEAD, "cpu": GiB // 2}, activations=ACTIVATIONS,
                       techniques=nothing_helps)


# 4-bit weights whose quantization state cannot be offloaded apart from them (bitsandbytes): never streamed.
PACKED = FormatLimit(label="nf4 (bitsandbytes)",
                     refused={PlacementKind.OFFLOADED: "its packed weights and their quantization state cannot be "
                                                       "offloaded apart",
                              PlacementKind.DISK: "its packed weights and their quantization state cannot be "
                                                  "offloaded apart"},
                     advice={PlacementKind.OFFLOADED: "Give its accelerator room for it whole."})


def test_a_component_whose_format_cannot_stream_stays_resident_and_another_is_offloaded():
    components = {"text_encoder": whole(3, 3), "transformer": whole(2, 2), "vae": whole(1)}
    budget, runs = {0: 11 * GiB // 2, "cpu": 64 * GiB}, {"transformer": 10}  # not all three whole
    free = placement.plan(components, max_memory=budget, runs_per_call=runs)
    assert free.components["text_encoder"].kind is PlacementKind.OFFLOADED  # what the search does unconstrained
    plan = placement.plan(components, max_memory=budget, runs_per_call=runs, format_limits={"text_encoder": PACKED})
    assert plan.components["text_encoder"].kind is PlacementKind.WHOLE
    assert any(c.kind is PlacementKind.OFFLOADED for c in plan.components.values())
    assert "text_encoder (nf4 (bitsandbytes)) kept whole on GPU 0: its format cannot be offloaded, so the other " \
           "components were planned around it." in plan.warnings


def test_where_it_can_only_stream_the_error_names_its_format():
    with pytest.raises(DoesNotFitError, match=r"Component 'text_encoder' \(nf4 \(bitsandbytes\), 3.00 GiB\) would "
                                              r"have to be offloaded.*quantization state") as caught:
        placement.plan({"text_encoder": whole(3, 3)}, max_memory={0: 2 * GiB, "cpu": 64 * GiB},
                       format_limits={"text_encoder": PACKED})
    assert caught.value.format_refused == "text_encoder"


def test_format_limits_are_checked():
    with pytest.raises(placement.PlanError, match="format_limits names components that do not exist"):
        placement.plan(COMPONENTS, max_memory=ONE_GPU, format_limits={"unet": PACKED})
    with pytest.raises(placement.PlanError, match="must be placement.FormatLimit"):
        placement.plan(COMPONENTS, max_memory=ONE_GPU, format_limits={"vae": "bitsandbytes"})

"""No component is needlessly sent to the CPU: when the strategy's own plan would execute one there, components
placed whole on an accelerator are demoted to "offloaded" (weights in RAM, streamed; offloaded components on
one device share the streaming room) if that lets everything execute on an accelerator; of those plans, the one
moving the fewest bytes per call wins, so the component that runs most keeps its room. Each demotion is
recorded in the plan with its reason and numbers.
"""

from itertools import product

import networkx as nx
import pytest

import placement
from placement import PlacementKind
from placement.sizing import size_module
from placement.streaming import streaming_working_set
from synthetic import GiB, component, whole

STEPS = range(40, 0, -1)  # the GPU budget, in 40ths of the pipeline's weights


def kinds(plan):
    return {name: c.kind for name, c in plan.components.items()}


def cpu_bytes(plan):
    return sum(c.bytes for c in plan.components.values() if c.execution_device == "cpu")


def demoted(plan):
    return {fallback.component for fallback in plan.fallbacks if fallback.demoted}


@pytest.fixture(scope="module")
def tiny_flux():
    """The tiny-flux preset on meta: its module components, their graph, sizes and streaming working sets."""
    from pipeline_fixtures import tiny_flux_on_meta
    from pipelines.loading.planning import modules_and_edges

    components, edges = modules_and_edges(tiny_flux_on_meta())
    sizes = {name: size_module(module) for name, module in components.items()}
    streamed = {name: streaming_working_set(components[name], sizes[name]) for name in components}
    return components, edges, {name: s.total for name, s in sizes.items()}, streamed


def one_gpu_oracle(budget, sizes, streamed):
    """Every assignment of whole / streamed / cpu to the components on one GPU (no activations): whole ones
    add up, streamed ones share the largest working set. The best by (cpu bytes, bytes moved per call: each
    streamed component's, once)."""
    best = None
    names = list(sizes)
    for kinds_ in product(("whole", "streamed", "cpu"), repeat=len(names)):
        chosen = dict(zip(names, kinds_))
        resident = sum(sizes[n] for n in names if chosen[n] == "whole")
        room = max((streamed[n] for n in names if chosen[n] == "streamed"), default=0)
        if resident + room > budget:
            continue
        cost = (
            sum(sizes[n] for n in names if chosen[n] == "cpu"),
            sum(sizes[n] for n in names if chosen[n] == "streamed"),
        )
        best = cost if best is None or cost < best else best
    return best


def test_stepping_budget_executes_nothing_needlessly_on_the_cpu(tiny_flux):
    components, edges, sizes, streamed = tiny_flux
    total = sum(sizes.values())
    previous_cpu = 0
    for step in STEPS:  # largest budget first: CPU bytes may only grow as the budget shrinks
        budget = total * step // 40
        plan = placement.plan(components, max_memory={0: f"{budget}B", "cpu": "8GiB"}, graph=edges)
        if budget >= max(streamed.values()):  # every component can be streamed to the GPU at once
            assert cpu_bytes(plan) == 0, (step, plan.explain())
        assert cpu_bytes(plan) >= previous_cpu, (step, plan.explain())
        previous_cpu = cpu_bytes(plan)
        oracle = one_gpu_oracle(budget, sizes, streamed)
        if oracle[0] == 0:  # where all of it can run on the GPU, the plan moves no more than the best assignment
            assert (cpu_bytes(plan), plan.transfer_bytes_per_call) <= oracle, (step, plan.explain())
        for name in demoted(plan):
            assert plan.components[name].kind is PlacementKind.OFFLOADED
            assert plan.components[name].execution_device == 0


def test_95_percent_keeps_the_transformer_whole_and_moves_least_of_the_text_encoders(tiny_flux):
    components, edges, sizes, _ = tiny_flux
    plan = placement.plan(components, max_memory={0: f"{sum(sizes.values()) * 38 // 40}B", "cpu": "8GiB"}, graph=edges)
    assert plan.components["transformer"].kind is PlacementKind.WHOLE
    assert cpu_bytes(plan) == 0 and all(c.execution_device == 0 for c in plan.components.values())
    assert demoted(plan) and "transformer" not in demoted(plan)
    # Streaming both encoders moves all of their bytes; keeping parts of them resident moves less.
    assert plan.transfer_bytes_per_call < sizes["text_encoder"] + sizes["text_encoder_2"]
    text = plan.explain()
    assert "(demoted)" in text and "moves the fewest bytes per call" in text


def test_encoders_are_demoted_so_the_denoiser_stays_whole():
    # Largest first: denoiser (6 GiB) and te1 (3) fill the 9 GiB GPU, and te2 has no room to stream.
    # Streaming both encoders needs max(3, 2) GiB beside the whole denoiser: 9 GiB, everything on the GPU.
    # The denoiser is one block (it cannot stay partly resident) and runs every step.
    comps = {"te1": component([1.5, 1.5]), "te2": component([1, 1]), "denoiser": whole(6)}
    plan = placement.plan(comps, max_memory={0: "9GiB", "cpu": "64GiB"}, runs_per_call={"denoiser": 20})
    assert kinds(plan) == {"te1": PlacementKind.OFFLOADED, "te2": PlacementKind.OFFLOADED,
                           "denoiser": PlacementKind.WHOLE}
    assert plan.device(0).predicted_peak == 9 * GiB and plan.device(0).activation_peak == 3 * GiB
    assert demoted(plan) == {"te1", "te2"} and plan.placement_order[-2:] == ["te1", "te2"]
    assert plan.transfer_bytes_per_call == 5 * GiB  # each encoder once per call
    reasons = {fallback.component: fallback.reason for fallback in plan.fallbacks}
    assert "Demoted from whole on GPU 0 (3.00 GiB) to offloaded" in reasons["te1"]
    assert "te2 (2.00 GiB)" in reasons["te1"] and "on the CPU now: nothing" in reasons["te1"]
    assert "Streamed to an accelerator (2.00 GiB) instead of running on the CPU" in reasons["te2"]
    assert placement.Plan.from_json(plan.to_json()) == plan


def test_a_denoiser_that_runs_every_step_streams_nothing_per_run():
    # Balanced does better than streaming both encoders (5 GiB per call): te1 stays whole, and the 2 GiB of
    # the denoiser that do not fit beside it are loaded once per call into the room te2's phase needs anyway
    # (te2 streams its 2 GiB once): 4 GiB per call, and nothing moves at each of the denoiser's 20 runs.
    comps = {"te1": component([1.5, 1.5]), "te2": component([1, 1]), "denoiser": whole(6, 6)}
    plan = placement.plan(comps, max_memory={0: "9GiB", "cpu": "64GiB"}, runs_per_call={"denoiser": 20})
    denoiser = plan.components["denoiser"].transfer
    assert (denoiser.resident_bytes, denoiser.loaded_per_call_bytes, denoiser.streamed_per_run_bytes) == (
        4 * GiB, 2 * GiB, 0)
    assert plan.transfer_bytes_per_call == 4 * GiB and cpu_bytes(plan) == 0
    assert plan.device(0).predicted_peak == 9 * GiB and plan.device(0).peak_phase == "denoiser"


def test_runs_per_call_decides_which_component_keeps_its_room():
    comps = {"a": whole(6, 6), "b": component([1.5, 1.5]), "c": whole(2, 2)}
    budgets = {0: "9GiB", "cpu": "64GiB"}
    # Every component runs once: the plan keeps the most bytes resident (7 GiB beside 2 GiB for the blocks in
    # flight of the one streaming): 4 GiB per call, nothing on the CPU.
    plan = placement.plan(comps, max_memory=budgets)
    assert plan.transfer_bytes_per_call == 4 * GiB and cpu_bytes(plan) == 0
    graph = nx.DiGraph([("a", "b"), ("b", "c")])
    graph.nodes["b"]["runs_per_call"] = 30  # b runs once per step: it stays whole and moves nothing
    plan = placement.plan(comps, max_memory=budgets, graph=graph)
    assert kinds(plan)["b"] is PlacementKind.WHOLE and plan.components["b"].transfer.bytes_per_call == 0
    assert "a" in demoted(plan) and cpu_bytes(plan) == 0
    # The same through the argument, which wins over the graph's attribute.
    assert placement.plan(comps, max_memory=budgets, graph=graph, runs_per_call={"b": 30}).components == plan.components
    # a running every step instead: nothing of a moves at each run (what does not fit beside b loads once per
    # call, in the room c's phase needs anyway): 4 GiB per call, not a's 2 GiB 28 times.
    plan = placement.plan(comps, max_memory=budgets, runs_per_call={"a": 28})
    assert plan.components["a"].transfer.streamed_per_run_bytes == 0 and plan.transfer_bytes_per_call == 4 * GiB


@pytest.mark.parametrize("runs", [0, 2.5, "28", True])
def test_bad_runs_per_call_is_a_graph_error(runs):
    graph = nx.DiGraph([("a", "b")])
    graph.nodes["b"]["runs_per_call"] = runs
    with pytest.raises(placement.PlanError, match=r"'b' has runs_per_call=.*int >= 1"):
        placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "4GiB", "cpu": "4GiB"}, graph=graph)


def test_two_unstreamable_components_share_the_streaming_room():
    # Each is one block (streaming keeps all of it on the device), but they run one after another: both
    # streamed need 4 GiB at once, not 7. Before demotions, b ran on the CPU.
    plan = placement.plan({"a": whole(4), "b": whole(3)}, max_memory={0: "4GiB", "cpu": "64GiB"})
    assert kinds(plan) == {"a": PlacementKind.OFFLOADED, "b": PlacementKind.OFFLOADED}
    assert plan.device(0).predicted_peak == 4 * GiB and demoted(plan) == {"a", "b"}


@pytest.mark.parametrize("strategy", ["sequential", "balanced_low_0", {"c": 1}])
def test_every_strategy_demotes(strategy):
    comps = {"a": whole(4), "b": whole(3), "c": whole(1)}
    plan = placement.plan(comps, max_memory={0: "4GiB", 1: "1GiB", "cpu": "64GiB"}, strategy=strategy)
    assert cpu_bytes(plan) == 0 and {"a", "b"} <= demoted(plan), plan.explain()
    if isinstance(strategy, dict):  # a dict strategy's pins are the caller's: never demoted
        assert plan.components["c"].pinned and kinds(plan)["c"] is PlacementKind.WHOLE


def test_pinned_components_are_never_demoted():
    comps = {"a": whole(4), "b": whole(3)}
    plan = placement.plan(comps, max_memory={0: "4GiB", "cpu": "64GiB"}, pinned={"a": 0})
    assert plan.components["a"].pinned and kinds(plan) == {"a": PlacementKind.WHOLE, "b": PlacementKind.CPU}
    assert demoted(plan) == set()


def test_a_demotion_can_rescue_a_plan_that_would_not_fit(tmp_path):
    # RAM holds 1 GiB: without demotions b (one 4 GiB block) fills the GPU and a must go to disk, where no
    # device can run it (the GPU is full; the CPU has 1 GiB for a's 2 GiB working set). Streamed from disk
    # one after another, both run on the GPU.
    comps = {"a": whole(3, 3), "b": whole(4)}
    budgets = {0: "4GiB", "cpu": "1GiB"}
    with pytest.raises(placement.DoesNotFitError):  # what the strategy alone gives (b pinned where it puts it)
        placement.plan(comps, max_memory=budgets, offload_folder=tmp_path, pinned={"b": 0})
    plan = placement.plan(comps, max_memory=budgets, offload_folder=tmp_path)
    assert kinds(plan) == {"a": PlacementKind.DISK, "b": PlacementKind.DISK}
    assert {c.execution_device for c in plan.components.values()} == {0}
    assert "Without demotions planning fails" in plan.fallbacks[0].reason
    with pytest.raises(placement.DoesNotFitError, match="no offload_folder was given"):  # without it: a clear error
        placement.plan(comps, max_memory=budgets)


def test_nothing_demoted_when_the_strategy_already_runs_all_on_accelerators():
    comps = {"a": whole(4), "b": whole(3, 3)}
    plan = placement.plan(comps, max_memory={0: "4GiB", 1: "3GiB", "cpu": "64GiB"})
    assert kinds(plan) == {"a": PlacementKind.WHOLE, "b": PlacementKind.WHOLE} and demoted(plan) == set()


def test_bad_runs_per_call_on_a_pinned_component_is_an_error_too():
    graph = nx.DiGraph([("a", "b")])
    graph.nodes["a"]["runs_per_call"] = -1
    with pytest.raises(placement.PlanError, match=r"'a' has runs_per_call=-1"):
        placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "4GiB", "cpu": "4GiB"}, graph=graph,
                       pinned={"a": 0})

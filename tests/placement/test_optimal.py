"""Balanced places whole components within 5% of the best whole-component map (issue 11).

The oracle tries every assignment of whole components to accelerators under the Plan's memory model
(weights + the largest activation among the components executing there + the runtime overhead once a device
is used, as a share of its budget) and keeps the smallest fullest share. The planner must come within 5% of
it, inside every budget, whenever the oracle finds a map that fits; then fewer crossing edges, then the
zig-zag map, break ties.
"""

from __future__ import annotations

import math
import random
from itertools import product

import networkx as nx
from hypothesis import HealthCheck, given, settings, strategies as st

import placement
from placement import ACCELERATOR_RUNTIME_OVERHEAD, PlacementKind
from placement.sizes import GiB
from placement.strategies.assignment import Item, Problem, Slot, best_assignment
from synthetic import component, whole

MiB = 1024**2
UNIT = 256 * MiB  # the 1 GiB runtime overhead is 4 units


def oracle(weights, activations, budgets, overhead):
    """The smallest fullest share over every whole assignment that fits (None: none fits), by brute force."""
    best = None
    for assignment in product(range(len(budgets)), repeat=len(weights)):
        share = 0.0
        for gpu, budget in enumerate(budgets):
            here = [i for i, g in enumerate(assignment) if g == gpu]
            if not here:
                continue
            peak = sum(weights[i] for i in here) + max(activations[i] for i in here) + overhead
            share = max(share, peak / budget) if peak <= budget else math.inf
        if share <= 1 and (best is None or share < best):
            best = share
    return best


@st.composite
def pipelines(draw):
    count = draw(st.integers(2, 7))
    weights = [draw(st.integers(1, 24)) for _ in range(count)]
    gpus = draw(st.lists(st.integers(4, 48), min_size=1, max_size=4))  # unequal sizes, in units
    with_activations = draw(st.booleans())
    activations = [draw(st.integers(0, 12)) if with_activations else 0 for _ in range(count)]
    chain = draw(st.booleans())
    return weights, activations if with_activations else None, gpus, chain


def fullest(plan):
    return max(d.predicted_peak / d.budget for d in plan.devices if isinstance(d.device, int) and d.budget)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(), st.sampled_from(["balanced", "auto"]))
def test_fullest_device_within_5_percent_of_the_oracle(pipeline, strategy):
    weights, activations, gpus, chain = pipeline
    names = [f"c{i}" for i in range(len(weights))]
    modules = {name: component([w], unit=UNIT) for name, w in zip(names, weights)}
    edges = list(zip(names, names[1:])) if chain else []
    max_memory = {i: units * UNIT for i, units in enumerate(gpus)}
    max_memory["cpu"] = 1000 * UNIT
    acts = None if activations is None else {n: a * UNIT for n, a in zip(names, activations)}
    plan = placement.plan(modules, max_memory=max_memory, strategy=strategy, graph=edges, activations=acts)
    overhead = ACCELERATOR_RUNTIME_OVERHEAD // UNIT if acts is not None else 0
    best = oracle(weights, activations or [0] * len(weights), gpus, overhead)
    if best is None:
        return  # no whole map fits: the fallbacks decide (test_properties checks them)
    assert all(c.kind is PlacementKind.WHOLE for c in plan.components.values()), plan.explain()
    assert all(d.budget is None or d.predicted_peak <= d.budget for d in plan.devices), plan.explain()
    assert fullest(plan) <= best * 1.05 + 1e-9, (fullest(plan), best, plan.explain())


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 10)), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(10, 60), st.integers(0, 10), st.integers(0, 5)), min_size=1, max_size=4),
    st.integers(0, 3),
)
def test_the_search_matches_brute_force_with_devices_already_holding_something(items, slots, overhead):
    problem = Problem(
        items=tuple(Item(name=str(i), weights=w, transient=t) for i, (w, t) in enumerate(items)),
        slots=tuple(
            Slot(device=i, budget=b, weights=w, transient=t, used=w > 0, overhead=overhead)
            for i, (b, w, t) in enumerate(slots)
        ),
        edges=tuple((i, i + 1) for i in range(len(items) - 1)),
    )
    best = None
    for assignment in product(range(len(slots)), repeat=len(items)):
        peaks = []
        for s, slot in enumerate(problem.slots):
            here = [problem.items[i] for i, g in enumerate(assignment) if g == s]
            used = slot.used or bool(here)
            transient = max([slot.transient] + [item.transient for item in here])
            peaks.append(slot.weights + sum(i.weights for i in here) + transient + (slot.overhead if used else 0))
        # Like the ledger: a device must fit what it is given; one given nothing counts only for the share.
        given = {s for s in assignment}
        if all(p <= slot.budget for s, (p, slot) in enumerate(zip(peaks, problem.slots)) if s in given):
            share = max(p / slot.budget for p, slot in zip(peaks, problem.slots))
            best = share if best is None else min(best, share)
    found = best_assignment(problem)
    assert (found is None) == (best is None)
    if found is not None:
        assert math.isclose(found.optimum, best) and found.fullest <= best * 1.05 + 1e-12


def test_unequal_gpus_the_zigzag_overfills_the_small_one():
    # Zig-zag: 10 -> GPU 0, 8 -> GPU 1, 4 -> GPU 1 (12 of 12 GiB); the best whole map puts 10 + 4 on the 24 GiB.
    comps = {"te": whole(4), "denoiser": whole(10), "vae": whole(8)}
    plan = placement.plan(comps, max_memory={0: "24GiB", 1: "12GiB", "cpu": "64GiB"}, graph=[])
    assert plan.device_map == {"te": 0, "denoiser": 0, "vae": 1}
    assert math.isclose(fullest(plan), 8 / 12)
    assert plan.map_reasons[0].startswith("The zig-zag map (diffusers') fills the fullest device to 100%")
    assert "te on GPU 0, not GPU 1 as in the zig-zag map" in plan.map_reasons[1]
    assert "Why this map:" in plan.explain()


def test_the_vae_decode_peak_moves_it_away_and_explain_says_why():
    # SD3-like on 2 x 12 GiB. Zig-zag: te3, te1 and vae on GPU 0, which peaks at 8.75 + 3 (vae's decode) + 1
    # (overhead) = 12.75 GiB > 12. The vae goes beside the transformer, whose own peak is 2 GiB.
    comps = {"te1": whole(0.5), "te2": whole(1), "te3": whole(8), "transformer": whole(4, 4), "vae": whole(0.25)}
    acts = {"te1": GiB // 4, "te2": GiB // 4, "te3": GiB // 2, "transformer": 2 * GiB, "vae": 3 * GiB}
    plan = placement.plan(comps, max_memory={0: "12GiB", 1: "12GiB", "cpu": "64GiB"}, activations=acts)
    assert plan.device_map["vae"] == plan.device_map["transformer"] != plan.device_map["te3"]
    assert plan.fallbacks == [] and fullest(plan) <= 10 / 12
    assert plan.map_reasons[0] == (
        "The zig-zag map (diffusers') does not fit: GPU 0 would peak at 12.75 GiB, over its 12.00 GiB budget."
    )
    assert (
        "vae on GPU 1, not GPU 0 as in the zig-zag map: its 3.00 GiB activation peak does not fit beside te3, te1 "
        "there (GPU 0 would peak at 12.75 GiB, budget 12.00 GiB)."
    ) in plan.map_reasons
    assert "Why this map:" in plan.explain() and plan.map_reasons[0] in plan.explain()
    assert placement.Plan.from_json(plan.to_json()) == plan


def test_near_optimal_maps_prefer_fewer_crossing_edges():
    # Two chains a -> c and b -> d. The zig-zag (a: 0, b: 1, c: 1, d: 0) is balanced but crosses on both
    # edges; {a, c} and {b, d} is as balanced and crosses on none.
    comps = {"a": whole(4), "b": whole(4), "c": whole(1), "d": whole(1)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"}, graph=[("a", "c"), ("b", "d")])
    assert plan.device_map == {"a": 0, "b": 1, "c": 0, "d": 1} and plan.crossing_edges == []
    assert "2 model-graph edges cross devices there; here 0" in plan.map_reasons[0]


def test_ties_go_to_the_zigzag_map_and_then_no_reason_is_given():
    comps = {name: whole(2) for name in "abcd"}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"}, graph=[])
    assert plan.device_map == {"a": 0, "b": 1, "c": 1, "d": 0}  # largest first (ties: order) over 0, 1, 1, 0
    assert plan.map_reasons == [] and "Why this map" not in plan.explain()


def test_balanced_low_0_minimises_what_gpu_0_takes():
    comps = {"a": whole(6), "b": whole(5), "c": whole(1)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "7GiB", 2: "6GiB", "cpu": "1GiB"}, strategy="balanced_low_0")
    assert plan.device(0).weight_bytes == 0 and set(plan.device_map.values()) == {1, 2}


def test_pinned_components_count_and_their_edges_are_crossings_too():
    comps = {"te": whole(2), "denoiser": whole(6), "vae": whole(1)}
    plan = placement.plan(comps, max_memory={0: "10GiB", 1: "10GiB", "cpu": "1GiB"}, strategy={"denoiser": 1})
    assert plan.components["denoiser"].pinned and plan.device_map["denoiser"] == 1
    assert plan.device(0).weight_bytes + plan.device(1).weight_bytes == 9 * GiB
    assert fullest(plan) <= 7 / 10 * 1.05


def test_eight_gpus_by_eight_components_plans_well():
    # Its speed is measured in benchmarks/placement_quality.py (plan time), not asserted here.
    rng = random.Random(8)
    comps = {f"c{i}": whole(rng.randint(1, 12)) for i in range(8)}
    budgets = {i: "16GiB" for i in range(8)} | {"cpu": "1GiB"}
    plan = placement.plan(comps, max_memory=budgets)
    assert all(c.kind is PlacementKind.WHOLE for c in plan.components.values())
    weights = [c.bytes / GiB for c in plan.components.values()]
    assert fullest(plan) <= max(max(weights), sum(weights) / 8) / 16 * 1.05 + 1e-9 or fullest(plan) <= 1


def test_crossings_count_on_a_dag_with_branches():
    graph = nx.DiGraph([("te1", "den"), ("te2", "den"), ("den", "vae")])
    comps = {"te1": whole(1), "te2": whole(5), "den": whole(6), "vae": whole(1)}
    plan = placement.plan(comps, max_memory={0: "8GiB", 1: "8GiB", "cpu": "1GiB"}, graph=graph)
    # The best fullest is 7 of 8 ({den, te1 or vae} | {te2, the other}); each such map crosses on 2 edges, as
    # does {den, te1, vae} | {te2} only at 8 of 8 (past 5%), so 2 is the fewest.
    assert math.isclose(fullest(plan), 7 / 8) and len(plan.crossing_edges) == 2


def test_demotion_search_finds_the_best_resident_set_past_eight_components():
    # 11 streamable components on one 10 GiB GPU. Largest first: den (5), mid (1.2), seven 0.5 GiB encoders
    # fill 9.7 GiB, and the last two encoders (one block each: streaming keeps all of it on the GPU) have no
    # room and would run on the CPU. Streaming mid alone (12 blocks: 0.2 GiB at once) lets everything else stay
    # whole: 9.5 + 0.2 GiB. The nested smallest-first sets the search used past 8 components reach only
    # {3 encoders} (1.5 GiB streamed per call); the best-first search finds {mid} (1.2 GiB).
    comps = {"den": whole(5, 5), "mid": whole(1.2, 12), **{f"e{i}": whole(0.5) for i in range(9)}}
    plan = placement.plan(comps, max_memory={0: "10GiB", "cpu": "64GiB"})
    demoted = {f.component for f in plan.fallbacks if f.demoted}
    assert demoted == {"mid"}, plan.explain()
    assert plan.components["mid"].kind is PlacementKind.OFFLOADED and plan.components["mid"].execution_device == 0
    assert all(plan.components[name].kind is PlacementKind.WHOLE for name in comps if name != "mid")
    assert plan.device(0).predicted_peak <= 10 * GiB


def test_best_first_sets_visit_every_subset_once_cheapest_first():
    from placement.cost import CostModel, least_moved
    from placement.strategies.options import best_first_sets
    from placement.strategies.state import ComponentRequest
    from placement.sizing import size_module

    modules = {f"c{i}": whole(size) for i, size in enumerate([3, 1, 2, 2, 5])}
    requests = [
        ComponentRequest(name=n, module=m, size=size_module(m), dtype=None, activation=None, position=i, streamed=0)
        for i, (n, m) in enumerate(modules.items())
    ]
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    costs = CostModel.build(graph, requests)
    sets = list(best_first_sets(requests, costs.runs))
    assert len(sets) == 2**5 - 1 and len({frozenset(r.name for r in s) for s in sets}) == 2**5 - 1
    keys = [least_moved(s, costs.runs) for s in sets]  # the bytes each demotion moves at least
    assert keys == sorted(keys)

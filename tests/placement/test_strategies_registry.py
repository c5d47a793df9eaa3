"""Strategies are looked up in one registry, take an immutable request and return the state they built."""

from dataclasses import replace

import networkx as nx
import pytest

import placement
from placement.budgets import resolve_budgets
from placement.memory_model import Ledger
from placement.sizing import size_module
from placement.strategies import (
    STRATEGIES, Context, CostModel, ComponentRequest, PlacementState, StrategyKind, StrategyRequest, parse_strategy,
    place_free_components,
)
from placement.strategies.fallbacks import place_whole
from synthetic import whole


def make_request(strategy, max_memory, sizes):
    modules = {f"c{i}": whole(size) for i, size in enumerate(sizes)}
    requests = [
        ComponentRequest(name=n, module=m, size=size_module(m), dtype=None, activation=None, position=i, streamed=0)
        for i, (n, m) in enumerate(modules.items())
    ]
    graph = nx.DiGraph(list(zip(modules, list(modules)[1:])))
    graph.add_nodes_from(modules)
    return StrategyRequest.build(
        spec=parse_strategy(strategy), requests=requests,
        ledger=Ledger(resolve_budgets(max_memory), activations_accounted=False), placed={},
        context=Context(has_offload_folder=False), costs=CostModel.build(graph, requests),
    )


def loads(ledger):
    return {device: (load.weights, load.transient, load.used) for device, load in ledger.loads.items()}


@pytest.mark.parametrize("strategy", ["balanced", "auto", "balanced_low_0", "sequential", 0])
def test_a_strategy_returns_its_state_and_leaves_the_request_alone(strategy):
    request = make_request(strategy, {0: "16GiB", 1: "16GiB", "cpu": "64GiB"}, [5, 4, 3, 2])
    before = loads(request.ledger)
    state = place_free_components(request)
    assert isinstance(state, PlacementState) and set(state.by_name) == {"c0", "c1", "c2", "c3"}
    assert loads(request.ledger) == before and dict(request.placed) == {}
    assert sum(load.weights for load in state.ledger.loads.values()) == 14 * 1024**3
    with pytest.raises(TypeError):
        state.by_name["c9"] = None  # the returned placements are read-only too


def test_every_kind_has_one_registry_entry_and_registering_is_one_line(monkeypatch):
    assert set(STRATEGIES) == set(StrategyKind)

    def everything_on_gpu_1(request: StrategyRequest) -> PlacementState:
        ledger, placements = request.start()
        for component in request.requests:
            placements.add(place_whole(component, ledger, 1))
        return PlacementState.of(ledger, placements)

    monkeypatch.setitem(STRATEGIES, StrategyKind.AUTO, everything_on_gpu_1)
    plan = placement.plan({"a": whole(1), "b": whole(1)}, max_memory={0: "8GiB", 1: "8GiB", "cpu": "1GiB"}, strategy="auto")
    assert plan.device_map == {"a": 1, "b": 1} and plan.strategy == "auto"


def test_a_request_is_frozen():
    request = make_request("balanced", {0: "8GiB", "cpu": "64GiB"}, [1])
    with pytest.raises(AttributeError):
        request.requests = ()
    assert replace(request, thorough=False).requests == request.requests

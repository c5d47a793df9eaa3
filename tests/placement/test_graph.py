"""The model graph: validation, execution order, crossing edges."""

import networkx as nx
import pytest

from placement import PlanError
from placement.graph import build_graph, crossing_edges, execution_order

NAMES = ["text_encoder", "denoiser", "vae"]


def test_no_graph_chains_the_mapping_order():
    graph = build_graph(NAMES, None)
    assert list(graph.edges) == [("text_encoder", "denoiser"), ("denoiser", "vae")]
    assert execution_order(graph, NAMES) == NAMES


def test_edge_list_gives_topological_order():
    names = ["vae", "denoiser", "text_encoder"]
    graph = build_graph(names, [("text_encoder", "denoiser"), ("denoiser", "vae")])
    assert execution_order(graph, names) == ["text_encoder", "denoiser", "vae"]


def test_ties_follow_the_mapping_order_and_unmentioned_nodes_are_kept():
    names = ["clip", "t5", "denoiser", "vae", "safety"]
    graph = build_graph(names, [("t5", "denoiser"), ("clip", "denoiser"), ("denoiser", "vae")])
    assert execution_order(graph, names) == ["clip", "t5", "denoiser", "vae", "safety"]


def test_a_digraph_is_accepted_and_copied():
    given = nx.DiGraph([("text_encoder", "denoiser"), ("denoiser", "vae")])
    given.nodes["denoiser"]["runs_per_call"] = 28
    graph = build_graph(NAMES, given)
    assert graph is not given and graph.nodes["denoiser"]["runs_per_call"] == 28


def test_self_loops_are_allowed():
    graph = build_graph(NAMES, [("text_encoder", "denoiser"), ("denoiser", "denoiser"), ("denoiser", "vae")])
    assert execution_order(graph, NAMES) == NAMES


def test_unknown_names_are_listed():
    with pytest.raises(PlanError, match=r"\['unet'\].*Known module components"):
        build_graph(NAMES, [("text_encoder", "unet")])


def test_cycles_are_rejected_with_the_cycle():
    with pytest.raises(PlanError, match="denoiser -> vae -> denoiser"):
        build_graph(NAMES, [("text_encoder", "denoiser"), ("denoiser", "vae"), ("vae", "denoiser")])


@pytest.mark.parametrize("edge", ["text_encoder->denoiser", ("a",), ("a", "b", "c"), 3])
def test_malformed_edges_are_quoted(edge):
    with pytest.raises(PlanError, match="Malformed model graph edge"):
        build_graph(NAMES, [edge])


def test_crossing_edges_are_those_between_execution_devices():
    graph = build_graph(NAMES, [("text_encoder", "denoiser"), ("denoiser", "denoiser"), ("denoiser", "vae")])
    assert crossing_edges(graph, {"text_encoder": 1, "denoiser": 0, "vae": 0}) == [("text_encoder", "denoiser")]
    assert crossing_edges(graph, {"text_encoder": 0, "denoiser": 0, "vae": 0}) == []

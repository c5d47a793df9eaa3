"""The model graph: a networkx.DiGraph over module components, edge a -> b when b consumes a's output.

Its topological order is the execution order. Without a graph, the mapping's order is the chain. A self-loop
(a denoiser fed its own output, step after step) is allowed; any other cycle is an error.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import networkx as nx

from .devices import Device
from .errors import PlanError


def build_graph(names: Sequence[str], graph: nx.DiGraph | Iterable | None) -> nx.DiGraph:
    """A validated DiGraph over `names`; components the graph does not mention become isolated nodes."""
    if graph is None:
        chain = nx.DiGraph()
        chain.add_nodes_from(names)
        chain.add_edges_from(zip(names, names[1:]))
        return chain
    built = graph.copy() if isinstance(graph, nx.DiGraph) else _from_edges(graph)
    known = set(names)
    unknown = sorted(str(node) for node in built.nodes if node not in known)
    if unknown:
        raise PlanError(
            f"The model graph names components that do not exist: {unknown}. "
            f"Known module components: {list(names)}."
        )
    built.add_nodes_from(name for name in names if name not in built)
    _reject_cycles(built)
    return built


def execution_order(graph: nx.DiGraph, names: Sequence[str]) -> list[str]:
    """Topological order; ties broken by the components' order in the mapping, so it is deterministic."""
    position = {name: index for index, name in enumerate(names)}
    return list(nx.lexicographical_topological_sort(_without_self_loops(graph), key=position.__getitem__))


def crossing_edges(graph: nx.DiGraph, execution_devices: Mapping[str, Device]) -> list[tuple[str, str]]:
    """The edges whose two ends execute on different devices (each one a device-to-device copy per call)."""
    order = list(execution_devices)
    edges = [
        (a, b) for a, b in graph.edges if a != b and execution_devices[a] != execution_devices[b]
    ]
    return sorted(edges, key=lambda edge: (order.index(edge[0]), order.index(edge[1])))


def _from_edges(edges) -> nx.DiGraph:
    built = nx.DiGraph()
    for edge in edges:
        if isinstance(edge, str) or not hasattr(edge, "__len__") or len(edge) != 2:
            raise PlanError(
                f"Malformed model graph edge {edge!r}: expected a pair (producer, consumer) such as "
                "('text_encoder', 'denoiser'), or pass a networkx.DiGraph."
            )
        built.add_edge(*edge)
    return built


def _reject_cycles(graph: nx.DiGraph) -> None:
    try:
        cycle = nx.find_cycle(_without_self_loops(graph))
    except nx.NetworkXNoCycle:
        return
    path = " -> ".join([str(a) for a, _ in cycle] + [str(cycle[0][0])])
    raise PlanError(
        f"The model graph has a cycle: {path}. Only a self-loop (a component consuming its own output) is "
        "allowed; remove one of these edges so the graph gives an execution order."
    )


def _without_self_loops(graph: nx.DiGraph) -> nx.DiGraph:
    """A copy without self-loops (a denoiser fed its own output): what the execution order is read from."""
    acyclic = nx.DiGraph(graph)
    acyclic.remove_edges_from(list(nx.selfloop_edges(acyclic)))
    return acyclic

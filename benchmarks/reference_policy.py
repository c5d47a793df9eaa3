"""The reference policy: a simple, explainable rule for what stays resident and what moves per call, the bar
the planner's residency search must clear (tests/placement/test_transfer_properties.py holds every plan to it on
random pipelines; benchmarks/transfers.py prints it beside ours). It lives beside the benchmarks, not in the
package: the planner never calls it. `placement.strategies.options` makes the same rule one of the search's
candidates (all components at FILL, blocks taken in execution order), which is why a plan never moves more.

Stated for one accelerator, made precise at block granularity:
- Each component k keeps `p_k` bytes resident across calls, chosen greedily: the component that runs most
  first (then the largest), each taking as many of its units as keep every phase able to run at its minimum
  (activations + its host-homed working set, `placement.cost.minimum_phase_weights`), units in order (the rest,
  then the blocks in execution order, first fit), on the home accelerator (the one with the largest budget),
  then, for a component whose layout may be cut across devices, on the others in index order (their phases: the
  activations of the components with units there).
- In k's phase the room left on the home is `budget - overhead - activations_k - sum_j p_j` (resident bytes of
  every component on the home). If the rest of k fits there it is loaded once per call, else k keeps loaded
  what fits for its phase beside its stream buffer (`c_k`: its host-homed rest, then blocks in execution order,
  first fit) and streams the remainder at every run. Either way the bytes are `placement.cost.bytes_per_call`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from placement.cost import bytes_per_call, minimum_phase_weights
from placement.streaming import TransferUnit


@dataclass(frozen=True, kw_only=True)
class ReferenceComponent:
    name: str
    units: tuple[TransferUnit, ...]  # streaming.transfer_units: the rest's pieces, then the blocks
    activation: int = 0
    runs: int = 1
    spreadable: bool = True  # its blocks may sit on several accelerators

    @property
    def bytes(self) -> int:
        return sum(unit.bytes for unit in self.units)


@dataclass(frozen=True, kw_only=True)
class ReferenceResult:
    home: int
    resident: dict[str, int]  # p_k: bytes resident across calls (all accelerators)
    bytes_per_call: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes_per_call.values())


@dataclass(kw_only=True)
class _State:
    budgets: dict[int, int]
    overhead: int
    home: int
    weights: dict[int, int] = field(default_factory=dict)
    host: dict[str, list[TransferUnit]] = field(default_factory=dict)
    spans: dict[str, set] = field(default_factory=dict)  # devices other than the home holding k's units

    def need(self, component: ReferenceComponent, device: int) -> int:
        if device == self.home:
            return component.activation + minimum_phase_weights(self.host[component.name])
        return component.activation if device in self.spans[component.name] else 0

    def fits(self, components: Sequence[ReferenceComponent], device: int) -> bool:
        need = max((self.need(c, device) for c in components), default=0)
        return self.weights[device] + need + self.overhead <= self.budgets[device]


def reference_transfer(components: Sequence[ReferenceComponent], budgets: Mapping[int, int], *,
                       overhead: int = 0) -> Optional[ReferenceResult]:
    """Bytes per call under the reference policy; None when some phase cannot run even with nothing resident.
    `components` in execution order; `budgets` per accelerator; `overhead` charged on every accelerator."""
    home = min(budgets, key=lambda d: (-budgets[d], d))
    state = _State(budgets=dict(budgets), overhead=overhead, home=home, weights=dict.fromkeys(budgets, 0),
                   host={c.name: list(c.units) for c in components}, spans={c.name: set() for c in components})
    if not state.fits(components, home):
        return None
    order = sorted(components, key=lambda c: (-c.runs, -c.bytes, components.index(c)))
    for component in order:
        for unit in component.units:
            _take(state, components, component, unit)
    resident = {c.name: c.bytes - sum(u.bytes for u in state.host[c.name]) for c in components}
    moved = {c.name: _phase_cost(state, c) for c in components}
    return ReferenceResult(home=home, resident=resident, bytes_per_call=moved)


def _take(state: _State, components, component: ReferenceComponent, unit: TransferUnit) -> None:
    """Make `unit` resident on the first device (home, then the others) where every phase still fits."""
    devices = [state.home, *sorted(d for d in state.budgets if d != state.home)]
    for device in devices if unit.block and component.spreadable else [state.home]:
        state.host[component.name].remove(unit)
        state.weights[device] += unit.bytes
        added = device != state.home and device not in state.spans[component.name]
        if added:
            state.spans[component.name].add(device)
        if state.fits(components, device) and state.fits(components, state.home):
            return
        state.weights[device] -= unit.bytes
        state.host[component.name].append(unit)
        state.host[component.name].sort(key=component.units.index)
        if added:
            state.spans[component.name].discard(device)


def _phase_cost(state: _State, component: ReferenceComponent) -> int:
    """Bytes per call of `component` in its phase: what is left on the host loaded once when it fits the room,
    else loaded what fits beside the stream buffer (the rest, then blocks in execution order) and the rest
    streamed."""
    host = state.host[component.name]
    remaining = sum(u.bytes for u in host)
    room = state.budgets[state.home] - state.overhead - component.activation - state.weights[state.home]
    if remaining <= room:
        return bytes_per_call(loaded=remaining, streamed=0, runs=component.runs)
    left = room - minimum_phase_weights(host)
    kept = sum(u.bytes for u in host if not u.block)
    for unit in (u for u in host if u.block):
        if unit.bytes <= left:
            left -= unit.bytes
            kept += unit.bytes
    return bytes_per_call(loaded=kept, streamed=remaining - kept, runs=component.runs)

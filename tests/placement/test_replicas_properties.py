"""Property tests of placement.plan_replicas() on small random inventories (mixed GPU sizes included).

Every replica plan must: use disjoint groups of the chosen size, with real device indices; keep each group's
plan on its own GPUs and every device's predicted peak within its budget; and give, for every group size, as
many replicas as a brute force over every way of cutting the real GPUs into groups (each group planned by
placement.plan on its real indices), resident ones first, streamed ones only when no group is resident.
"""

from __future__ import annotations

from itertools import combinations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import placement
from placement import ReplicaFit
from placement.replicas import replica_fit
from synthetic import component

MiB = 1024**2
UNIT = 256 * MiB

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def inventories(draw):
    count = draw(st.integers(1, 3))
    components = {
        f"c{i}": (draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)), draw(st.sampled_from([0, 1])))
        for i in range(count)
    }
    sizes = draw(st.lists(st.integers(1, 20), min_size=1, max_size=3, unique=True))
    gpus = draw(st.lists(st.sampled_from(sizes), min_size=1, max_size=5))
    cpu = draw(st.sampled_from([4, 40, 1000])) * UNIT
    activations = {name: draw(st.integers(0, 3)) * UNIT for name in components} if draw(st.booleans()) else None
    strategy = draw(st.sampled_from(["balanced", "sequential"]))
    return components, {i: units * UNIT for i, units in enumerate(gpus)}, cpu, activations, strategy


def build(components):
    return {name: component(blocks, head=head, unit=UNIT) for name, (blocks, head) in components.items()}


@SETTINGS
@given(inventories())
def test_replica_plan_properties(scenario):
    components, gpus, cpu, activations, strategy = scenario
    modules = build(components)
    replicas = placement.plan_replicas(
        modules, max_memory={**gpus, "cpu": cpu}, activations=activations, strategy=strategy
    )
    assert_groups_disjoint_and_real(replicas, gpus)
    assert_within_budgets(replicas)
    for option in replicas.options:
        expected = brute_force(modules, gpus, cpu, activations, strategy, option.group_size)
        assert (option.fit, option.replicas) == expected, option
    best = [o for o in replicas.options if o.fit is replicas.fit and o.replicas == replicas.replicas]
    if replicas.groups:
        assert replicas.group_size == min(o.group_size for o in best)
        assert replicas.fit is ReplicaFit.RESIDENT or all(o.fit is not ReplicaFit.RESIDENT for o in replicas.options)
        assert replicas.replicas == max(o.replicas for o in replicas.options if o.fit is replicas.fit)
    assert placement.ReplicaPlan.from_json(replicas.to_json()) == replicas


def assert_groups_disjoint_and_real(replicas, gpus):
    seen = [index for group in replicas.groups for index in group.accelerators]
    assert len(seen) == len(set(seen))
    assert sorted(seen + replicas.unused) == sorted(gpus)
    for number, group in enumerate(replicas.groups):
        assert group.replica == number
        assert len(group.accelerators) == replicas.group_size
        assert group.plan.accelerators == group.accelerators  # real indices, nothing else
        assert replica_fit(group.plan) is group.fit is replicas.fit


def assert_within_budgets(replicas):
    for group in replicas.groups:
        for device in group.plan.devices:
            assert device.budget is None or device.predicted_peak <= device.budget, (group.label, device)
        assert group.max_memory["cpu"] == replicas.cpu_share


def brute_force(modules, gpus, cpu, activations, strategy, size):
    """(fit, replicas) for `size` by trying every set of disjoint groups of real GPUs."""
    share = cpu // (len(gpus) // size)
    fits = {}
    for group in combinations(sorted(gpus), size):
        try:
            plan = placement.plan(
                modules, max_memory={**{i: gpus[i] for i in group}, "cpu": share}, strategy=strategy,
                activations=activations,
            )
            fits[group] = replica_fit(plan)
        except placement.DoesNotFitError:
            fits[group] = None
    for fit, accepted in ((ReplicaFit.RESIDENT, {ReplicaFit.RESIDENT}), (ReplicaFit.STREAMED, set(ReplicaFit))):
        count = most_groups(tuple(sorted(gpus)), size, {g for g, f in fits.items() if f in accepted})
        if count:
            return fit, count
    return None, 0


def most_groups(free, size, good):
    if len(free) < size:
        return 0
    first, rest = free[0], free[1:]
    best = most_groups(rest, size, good)  # the lowest free GPU in no group
    for others in combinations(rest, size - 1):
        group = (first, *others)
        if group in good:
            best = max(best, 1 + most_groups(tuple(i for i in rest if i not in others), size, good))
    return best

"""The transfer model (docs/design.md, "When it does not fit: what moves per call"): what crosses host -> accelerator
per call; the placement search (`strategies.search`) reads it to find the plan that moves the least.

inputs.py      `runs_per_call` and `link_bandwidth` as `placement.plan` takes them, checked
host_split.py  a component's host-homed units: loaded once per call or streamed at every run
fill.py        partial residency: as many units resident as the other phases leave room for
completion.py  every component's `ComponentTransfer` from its device map, for any strategy
What each choice costs (bytes per call, the stream buffer, the bounds) is `placement.cost`'s.
"""

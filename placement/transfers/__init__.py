"""The transfer model (docs/design.md, "When it does not fit: what moves per call"): what crosses host -> accelerator
per call; the placement search (`strategies.search`) reads it to find the plan that moves the least.

inputs.py     `runs_per_call` and the link and disk speeds as `placement.plan` takes them: checked, measured or assumed
blocks.py     a component's blocks: idle in the planned call, moved or kept (spread evenly), the room a phase leaves
residency.py  partial residency, the host-homed part loaded per call or streamed, every plan's `ComponentTransfer`
What each choice costs (bytes per call, the stream buffer, the bounds) is `placement.cost`'s.
"""

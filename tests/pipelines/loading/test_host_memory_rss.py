"""The plan's host memory is what a placed load and run holds: a child process loads a saved model placed by
`pipelines.load_model` and runs it, and its peak RSS above the baseline after imports stays within 10% of the
plan's host bytes (`Plan.host_memory`; on virtual accelerators their resident weights live in host RAM too, so
theirs are added). Memory only: no wall-clock verdict (the child runs under the suite's hang guard)."""

import json
import os
import sys

import pytest
import transformers

from child_process import run_child

# About 66 MB of float32 weights: large enough that the interpreter's noise (a few MB) is well under 10%.
T5 = dict(vocab_size=8000, d_model=512, d_kv=64, d_ff=2048, num_layers=4, num_heads=8)

CHILD = r"""
import json, sys
import torch, pipelines, placement
import transformers
from transformers.models.t5 import modeling_t5  # the libraries the load imports: part of the baseline

def status(field):
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field + ":"))

with torch.no_grad():
    torch.nn.Linear(8, 8)(torch.zeros(1, 8))  # the allocator's and the kernels' first-use allocations
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # reset the peak (VmHWM) to the current RSS
baseline = status("VmRSS")
model = pipelines.load_model(sys.argv[1], max_memory=json.loads(sys.argv[2]), progress=False)
loaded = status("VmRSS") - baseline
with torch.no_grad():
    model(input_ids=torch.ones(1, 16, dtype=torch.long))
plan = model.placement_plan
peak = status("VmHWM") - baseline
accelerators = sum(d.weight_bytes for d in plan.devices if placement.devices.is_accelerator(d.device))
print(json.dumps({"peak": peak, "loaded": loaded, "after": status("VmRSS") - baseline, "host": plan.host_memory.total_bytes,
                  "accelerators": accelerators, "kinds": [c.kind.value for c in plan.components.values()]}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak-RSS reset")
@pytest.mark.parametrize("accelerators, max_memory", [
    (0, {"cpu": "1GiB"}),  # computes on the CPU: every weight host-homed
    (1, {0: "40MiB", "cpu": "1GiB"}),  # streamed from host RAM to a virtual accelerator
], ids=["cpu", "offloaded"])
def test_peak_rss_of_a_placed_load_and_run_is_within_10_percent_of_the_plans_host_memory(
        tmp_path, accelerators, max_memory):
    transformers.T5EncoderModel(transformers.T5Config(**T5)).eval().save_pretrained(tmp_path / "t5")
    # Virtual accelerators as the plain CPU (not strict): a copy to one is then no copy, so what is measured is
    # the runtime's own host memory, with the accelerator's resident weights (held in host RAM here) beside it.
    env = {**os.environ, "PLACEMENT_VIRTUAL_ACCELERATORS": str(accelerators), "PLACEMENT_VIRTUAL_STRICT": "0"}
    done = run_child([sys.executable, "-c", CHILD, str(tmp_path / "t5"), json.dumps(max_memory)], env=env)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    planned = found["host"] + found["accelerators"]
    assert found["host"] > 30 * 2**20 and planned > 60 * 2**20, found  # tens of MB: the baseline does not dominate
    assert abs(found["peak"] - planned) <= 0.10 * planned, (
        f"peak RSS above the baseline {found['peak'] / 2**20:.1f} MiB vs planned {planned / 2**20:.1f} MiB "
        f"(host {found['host'] / 2**20:.1f} MiB + virtual accelerators {found['accelerators'] / 2**20:.1f} MiB, "
        f"{found['kinds']})")

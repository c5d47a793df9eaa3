"""`import placement` stays light: torch's distributed tools (MemTracker, ~150 modules, 1.6x the import) are
imported only where `measure_activations` measures, and sympy (torch's symbolic shapes) only once an estimate
runs, never at import."""

from __future__ import annotations

import subprocess
import sys

_CHECK = ("import sys, placement; "
          "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed._tools', 'sympy'))))")


def test_import_placement_imports_neither_torch_distributed_tools_nor_sympy():
    done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_measure_activations_still_measures_with_memtracker():
    import torch

    from placement.activations.estimate import measure_activations

    measured = measure_activations(torch.nn.Linear(4, 8), (torch.randn(2, 4),))
    assert measured >= 2 * 4 * 4 + 2 * 8 * 4  # its input and output, float32, at least

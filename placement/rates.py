"""The assumed rates a plan's bytes become seconds at, and the band within which those seconds are trusted: a
leaf module, so that the cost (`cost`), the time model (`time_model`) and the Plan's defaults read one copy of them.
"""

# Typical sustained host-to-device bandwidth (PCIe 4.0 x16, pinned memory) and NVMe read bandwidth, to turn
# bytes moved per run into a time a user can weigh. Real machines vary by 2x either way; the bytes are exact.
PCIE_BYTES_PER_S = 25e9
DISK_BYTES_PER_S = 3e9
# The model's error band, from benchmarks/published_runs.py's spread: four in five of the 35 published runs it
# expresses are predicted within 15% (28; the median within 7%; 32 of 35 within 20%). Plans state it, and the search
# only moves more bytes per call for a predicted gain beyond it (cost.PlanCost).
ERROR_BAND = 0.15

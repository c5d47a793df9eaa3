import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from placement.devices import VIRTUAL_STRICT_ENV
from placement.machine_profile import CACHE_ENV, FILE_NAME

# No property test's verdict depends on the machine's speed: no per-example deadline, no "generation too slow"
# health check (both wall-clock limits), for the tests that set their own settings too (they inherit these).
settings.register_profile("any-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("any-machine")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")
    parser.addoption(
        "--virtual-not-strict", action="store_true",
        help="run the virtual accelerators of PLACEMENT_VIRTUAL_ACCELERATORS as the plain CPU (PLACEMENT_VIRTUAL_STRICT=0)"
        " instead of strict vgpu devices; for comparing, the suite's default is strict",
    )


def pytest_configure(config):
    """Virtual accelerators are strict in the suite (each tensor on its vgpu device, mixing devices raises as on
    CUDA), whatever the shell says, so a device mix-up fails here as it would on GPUs. Set in the environment so
    that subprocess tests (the CLI) run strict too."""
    os.environ[VIRTUAL_STRICT_ENV] = "0" if config.getoption("--virtual-not-strict") else "1"
    # Plans use this machine's profile (`placement calibrate`) where one is saved: never the user's own in tests,
    # so every plan is the same on every machine; a test that wants one saves it into its own folder.
    os.environ[CACHE_ENV] = SUITE_CACHE[0] = tempfile.mkdtemp(prefix="placement-test-cache-")


SUITE_CACHE = [""]  # this process's cache folder (pytest_configure): the only one the fixture below empties


@pytest.fixture(autouse=True)
def no_machine_profile_from_an_earlier_test():
    """Each test starts without a machine profile: a placed run saves its corrections into the (per-worker) cache,
    and a later test's plan would read them (its link and compute rates then depend on what ran before it)."""
    if SUITE_CACHE[0]:
        Path(SUITE_CACHE[0], FILE_NAME).unlink(missing_ok=True)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with --run-slow; tests marked `gpu` need CUDA, tests marked `multi_gpu` two
    CUDA devices: all skipped (with a reason) otherwise, so the default suite stays fast and CPU-only. Virtual
    accelerators (PLACEMENT_VIRTUAL_ACCELERATORS) do not count: they are CPUs."""
    if not config.getoption("--run-slow"):
        slow = pytest.mark.skip(reason="slow: run with --run-slow")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(slow)
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needs = {"gpu": (1, "needs a CUDA device"), "multi_gpu": (2, "needs two CUDA devices")}
    for item in items:
        for marker, (count, reason) in needs.items():
            if item.get_closest_marker(marker) is not None and cuda_devices < count:
                item.add_marker(pytest.mark.skip(reason=reason))

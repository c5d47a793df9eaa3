import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with --run-slow; tests marked `gpu` need CUDA: both skipped (with a
    reason) otherwise, so the default suite stays fast and CPU-only."""
    if not config.getoption("--run-slow"):
        slow = pytest.mark.skip(reason="slow: run with --run-slow")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

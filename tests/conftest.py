import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; skip them (with a reason) on CPU-only machines such as CI."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA, tests marked `multi_gpu` two CUDA devices; skip them (with a reason) on
    machines without (CI). Virtual accelerators (PLACEMENT_VIRTUAL_ACCELERATORS) do not count: they are CPUs."""
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needs = {"gpu": (1, "needs a CUDA device"), "multi_gpu": (2, "needs two CUDA devices")}
    for item in items:
        for marker, (count, reason) in needs.items():
            if item.get_closest_marker(marker) is not None and cuda_devices < count:
                item.add_marker(pytest.mark.skip(reason=reason))

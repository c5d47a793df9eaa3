"""Z-Image's transformer holds parameters at its root (`x_pad_token`, `cap_pad_token`): served from every home a
plan can give it (the host, the disk), equal to diffusers' own run, and usable again after reset and `.to()`."""

from __future__ import annotations

import pytest
import torch

from cases import CASES
from pipelines import Pipeline
from same_output import assert_same_output
from test_e2e_diffusers import run

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
Z_IMAGE = next(case for case in CASES if case.name == "ZImagePipeline")


@pytest.fixture(scope="module")
def z_image(tmp_path_factory):
    root = tmp_path_factory.mktemp("z-image")
    torch.manual_seed(0)
    Z_IMAGE.build(root / "parts").save_pretrained(root / "z-image")
    return root / "z-image", run(diffusers.ZImagePipeline.from_pretrained(root / "z-image"), Z_IMAGE)


@pytest.mark.parametrize("home", ["disk", "cpu"])
def test_root_parameters_are_served_from_any_home_and_reset_leaves_a_usable_pipeline(z_image, home, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "1")
    folder, expected = z_image
    pipe = Pipeline.from_pretrained(folder, device_map={"transformer": home, "text_encoder": 0, "vae": 0},
                                    max_memory={0: "1GiB", "cpu": "4GiB"}, offload_folder=tmp_path, progress=False)
    assert pipe.placement_plan.components["transformer"].kind.value == home
    assert_same_output(run(pipe, Z_IMAGE), expected)
    pipe.reset_device_map()
    assert not [name for name, tensor in pipe.transformer.state_dict().items() if tensor.is_meta]
    assert_same_output(run(pipe.to("cpu"), Z_IMAGE), expected)

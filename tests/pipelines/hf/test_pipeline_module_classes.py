"""A component class from a pipeline's own module (issue 41): diffusers saves LTX-2's `connectors`, a
`diffusers.pipelines.ltx2` class, as ["ltx2", "LTX2TextConnectors"], and its loader reads any library that is a
`diffusers.pipelines` submodule. Such an entry resolves as trusted as any diffusers class, with no user step; our
save writes the entry diffusers writes; a library that is not such a submodule stays refused, importing nothing."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from pipelines import Pipeline
from pipelines.errors import UntrustedClassError
from pipelines.folder.model_index import ComponentSpec, resolve_class, spec_for
from same_output import assert_same_output

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.pipeline_loading_utils import _fetch_class_library_tuple  # noqa: E402

import tiny_videos  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
CALL = {"prompt": "a cat", "negative_prompt": "", "num_inference_steps": 2, "height": 32, "width": 32,
        "num_frames": 5, "max_sequence_length": 8}


@pytest.fixture(scope="module")
def ltx2_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx2")
    tiny_videos.ltx2(root / "parts").save_pretrained(root / "saved")
    return root / "saved"


def entries(folder) -> dict:
    index = json.loads((folder / "model_index.json").read_text())
    return {key: value for key, value in index.items() if isinstance(value, list)}


def run(pipe):
    with torch.no_grad():
        output = pipe(**CALL, generator=torch.Generator().manual_seed(0), output_type="pt")
    return output.frames.cpu(), output.audio.cpu()


def test_a_class_of_the_pipelines_own_module_loads_placed_with_no_user_step(ltx2_folder, monkeypatch, tmp_path):
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    assert entries(ltx2_folder)["connectors"] == ["ltx2", "LTX2TextConnectors"]  # as diffusers 0.42 saves it
    expected = run(diffusers.LTX2Pipeline.from_pretrained(ltx2_folder))
    pipe = Pipeline.from_pretrained(ltx2_folder, device_map="balanced", max_memory={0: "2GiB", 1: "2GiB"},
                                    call=CALL, progress=False)
    assert type(pipe.connectors) is diffusers.pipelines.ltx2.LTX2TextConnectors
    assert pipe.placement_plan.components["connectors"].execution_device in (0, 1)
    for placed, reference in zip(run(pipe), expected):
        assert_same_output(placed, reference)
    pipe.save_pretrained(tmp_path / "again")  # our save writes what diffusers writes, and loads again
    assert entries(tmp_path / "again") == entries(ltx2_folder)
    assert type(Pipeline.from_pretrained(tmp_path / "again", progress=False).connectors).__name__ == \
        "LTX2TextConnectors"


def test_our_entry_for_a_class_is_the_one_diffusers_writes():
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker

    for cls in (diffusers.pipelines.ltx2.LTX2TextConnectors, LTX2Vocoder, StableDiffusionSafetyChecker,
                diffusers.AutoencoderKL, diffusers.FlowMatchEulerDiscreteScheduler):
        instance = object.__new__(cls)  # the entry depends on the class alone
        assert tuple(spec_for(instance).to_json_value()) == _fetch_class_library_tuple(instance), cls


@pytest.mark.parametrize("library", ["DiffusionPipeline", "not_a_pipeline_module", "ltx2.connectors", "os",
                                     "pipeline_loading_utils.os"])
def test_a_library_that_is_no_diffusers_pipeline_module_stays_refused(library):
    before = set(sys.modules)
    with pytest.raises(UntrustedClassError, match="nothing was imported"):
        resolve_class(ComponentSpec(library=library, class_name="LTX2TextConnectors"), component="connectors")
    assert not {name for name in set(sys.modules) - before if library.split(".")[0] in name}

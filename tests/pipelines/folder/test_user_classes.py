"""One model world: a user's own pipeline is a `diffusers.DiffusionPipeline` subclass and a user's own model a
diffusers `ModelMixin` + `ConfigMixin`, saved by diffusers' own `save_pretrained`. Once registered
(`pipelines.register_class`), `pipelines.Pipeline.from_pretrained` loads the folder as the user's class, each model
placed by the planner (here split over two strict virtual GPUs), and `pipelines.load_model` loads one model as its
class; unregistered, the folder is refused with what to do (its code is never imported)."""

from __future__ import annotations

import pytest
import torch
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

import pipelines
from pipelines.errors import FolderError, LoadError
from pipelines.folder.families import DIFFUSERS, family_of


class WordEncoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(dim=1)


class StepDenoiser(ModelMixin, ConfigMixin):
    _no_split_modules = ["Linear"]

    @register_to_config
    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + context
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


class WordPipeline(DiffusionPipeline):
    model_cpu_offload_seq = "encoder->denoiser"

    def __init__(self, encoder: WordEncoder, denoiser: StepDenoiser):
        super().__init__()
        self.register_modules(encoder=encoder, denoiser=denoiser)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, steps: int = 2) -> torch.Tensor:
        context = self.encoder(ids.to(self._execution_device))
        x = torch.zeros_like(context)
        for _ in range(steps):
            x = self.denoiser(x, context)
        return x.cpu()


IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    pipe = WordPipeline(encoder=WordEncoder().eval(), denoiser=StepDenoiser().eval())
    pipe.save_pretrained(tmp_path / "words")
    return tmp_path / "words", pipe(IDS)


@pytest.mark.filterwarnings("ignore:Runs per call are not known")
def test_a_registered_diffusion_pipeline_subclass_loads_as_its_class_split_over_two_gpus(saved, monkeypatch):
    folder, expected = saved
    for cls in (WordPipeline, WordEncoder, StepDenoiser):
        pipelines.register_class(cls)
    monkeypatch.setenv("PLACEMENT_VIRTUAL_ACCELERATORS", "2")
    split = {"encoder": 0, "denoiser": {"blocks.0": 0, "blocks.1": 1, "blocks.2": 1}}
    pipe = pipelines.Pipeline.from_pretrained(folder, device_map=split, progress=False)
    assert type(pipe) is WordPipeline and family_of(StepDenoiser) is DIFFUSERS
    assert pipe.hf_device_map == {"encoder": 0, "denoiser.blocks.0": 0, "denoiser.blocks.1": 1,
                                  "denoiser.blocks.2": 1}
    # float32 on the CPU's kernels on both sides: equal to float32 rounding (tests/same_output.py)
    torch.testing.assert_close(pipe(IDS), expected, rtol=1e-6, atol=1e-6)
    pipe.reset_device_map()
    assert pipe.hf_device_map is None

    model = pipelines.load_model(folder / "denoiser", device_map={"blocks.0": 0, "blocks.1": 1, "blocks.2": 1},
                                 progress=False)
    assert type(model) is StepDenoiser and model.hf_device_map["blocks.2"] == 1


def test_an_unregistered_user_pipeline_is_refused_with_what_to_do(saved):
    folder, _ = saved
    index = (folder / "model_index.json").read_text()
    renamed = folder.parent / "renamed"
    folder.rename(renamed)
    (renamed / "model_index.json").write_text(index.replace("WordPipeline", "NeverRegisteredPipeline"))
    with pytest.raises(LoadError, match=r"'NeverRegisteredPipeline'.*register it first \(pipelines\.register_class"):
        pipelines.Pipeline.plan_placement(renamed)


def test_a_module_of_neither_library_is_refused_by_name():
    class Plain(nn.Module):
        pass

    with pytest.raises(FolderError, match="Plain is an nn.Module but neither a diffusers ModelMixin"):
        family_of(Plain)

"""Every write error during a save, from any writer, is a CheckpointSaveError naming the folder, and the folder
there is left as it was with nothing hidden beside it: full disk, a file too large, an I/O error, raised by our
safetensors and JSON writers, by the carried-over entries' copies, by diffusers' and transformers' writers, and by
the tokenizers library (whose Rust writer raises a bare `Exception("... (os error 27)")`), injected, and for real
(a file-size limit in a child process, so the kernel itself refuses the write with EFBIG)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import pipelines.checkpoint.files as config_file
import pipelines.checkpoint.saving as weights_saving
from pipelines import Pipeline
from pipelines.checkpoint import CheckpointSaveError
from pipelines.checkpoint.saving import is_write_error

from child_process import run_child
from own_fixtures import tiny_user_pipeline

ERRORS = {"ENOSPC": OSError(errno.ENOSPC, "No space left on device"), "EFBIG": OSError(errno.EFBIG, "File too large"),
          "EIO": OSError(errno.EIO, "Input/output error")}


def contents(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def hidden(folder: Path) -> list[str]:
    return [entry.name for entry in folder.iterdir() if entry.name.startswith(".")]


@contextmanager
def failing(owner, name: str, error: Exception, when=lambda *args, **kwargs: True):
    original = getattr(owner, name)

    def fail(*args, **kwargs):
        if when(*args, **kwargs):
            raise error
        return original(*args, **kwargs)

    setattr(owner, name, fail)
    try:
        yield
    finally:
        setattr(owner, name, original)


def in_staging(path, *args, **kwargs) -> bool:
    return ".saving-" in str(path)


WRITERS = {  # the writer, and how to make it fail with `error`
    "safetensors weights": lambda error: failing(weights_saving, "save_file", error),
    "config and model_index json": lambda error: failing(config_file.os, "replace", error, when=in_staging),
    "shard index json": lambda error: failing(Path, "write_text", error, when=lambda self, *a, **k: in_staging(self)
                                              and self.name.endswith(".index.json")),
    "copies of carried-over entries": lambda error: _no_links_and(failing(shutil, "copy2", error)),
}


@contextmanager
def _no_links_and(copy_failing):
    with failing(os, "link", OSError(errno.EXDEV, "Invalid cross-device link")), copy_failing:
        yield


@pytest.mark.parametrize("code", list(ERRORS))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_error_from_each_of_our_writers_leaves_the_folder_as_it_was(tmp_path, writer, code):
    target = tmp_path / "pipe"
    tiny_user_pipeline(seed=0).save_pretrained(target, max_shard_size=600)  # sharded: an index is written
    (target / "README.md").write_text("mine")  # carried over by the next save
    before = contents(target)
    with WRITERS[writer](ERRORS[code]):
        with pytest.raises(CheckpointSaveError, match=rf"Saving to '{target}' failed: {ERRORS[code].strerror} "
                                                      rf".*errno {ERRORS[code].errno}.*unchanged"):
            tiny_user_pipeline(seed=1).save_pretrained(target, max_shard_size=600)
    assert contents(target) == before and hidden(tmp_path) == []


def test_write_errors_are_told_from_other_errors():
    assert is_write_error(OSError(errno.EIO, "Input/output error"))
    assert is_write_error(Exception("File too large (os error 27)"))  # tokenizers' Rust writer
    assert not is_write_error(ValueError("size mismatch"))
    assert not is_write_error(None)


def test_a_diffusers_pipeline_write_error_from_its_owners_writers_leaves_the_folder_as_it_was(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    import safetensors.torch

    from test_diffusers_pipelines import build_flux

    build_flux(tmp_path / "parts").save_pretrained(tmp_path / "flux")
    pipe = Pipeline.from_pretrained(tmp_path / "flux", device_map="cpu", progress=False)
    target = tmp_path / "saved"
    pipe.save_pretrained(target)
    before = contents(target)
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    for make_fail in (lambda: failing(safetensors.torch, "save_file", ERRORS["ENOSPC"]),  # diffusers' writer
                      lambda: failing(safetensors.torch, "save_file", rust),
                      lambda: failing(type(pipe.tokenizer), "save_pretrained", rust)):
        with make_fail(), pytest.raises(CheckpointSaveError, match=rf"Saving to '{target}' failed: .*No space left"):
            pipe.save_pretrained(target)
        assert contents(target) == before and hidden(tmp_path) == []
    assert isinstance(pipe, diffusers.FluxPipeline)


CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    from pathlib import Path
    sys.path[:0] = sys.argv[2:]
    import transformers
    from pipelines import Pipeline
    from pipelines.checkpoint import CheckpointSaveError
    from bad_input_models import CatalogueEncoder, CatalogueEncoderConfig
    from tiny_parts import t5_tokenizer

    class WithTokenizer(Pipeline):
        model_graph = []

        def __init__(self, tokenizer, encoder):
            super().__init__()
            self.register_components(tokenizer=tokenizer, encoder=encoder)

    root = Path(sys.argv[1])
    pipes = {"tokenizers (tokenizer.json)": WithTokenizer(t5_tokenizer(), CatalogueEncoder(CatalogueEncoderConfig())),
             "safetensors (weights)": WithTokenizer(None, CatalogueEncoder(CatalogueEncoderConfig(vocab=256, width=16)))}
    for label, pipe in pipes.items():
        pipe.save_pretrained(root / label)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.RLIM_INFINITY))
    for label, pipe in pipes.items():
        before = {str(p): p.read_bytes() for p in (root / label).rglob("*") if p.is_file()}
        try:
            pipe.save_pretrained(root / label)
        except CheckpointSaveError as error:
            after = {str(p): p.read_bytes() for p in (root / label).rglob("*") if p.is_file()}
            print(json.dumps({"writer": label, "error": str(error), "intact": after == before}))
""")


def test_a_real_file_too_large_from_the_rust_writers_is_a_save_error(tmp_path):
    here = Path(__file__).resolve().parents[1]
    done = run_child([sys.executable, "-c", CHILD, str(tmp_path), str(here.parent / "bad_inputs"), str(here / "e2e")])
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [report["writer"] for report in reports] == ["tokenizers (tokenizer.json)", "safetensors (weights)"]
    for report in reports:
        assert "File too large (os error 27)" in report["error"] and "is unchanged" in report["error"]
        assert report["intact"] and str(tmp_path / report["writer"]) in report["error"]
    assert hidden(tmp_path) == []


def _second_write_fails(module):
    """`module.save_file` failing with ENOSPC on its second call: a full disk midway through a save."""
    calls = []
    return failing(module, "save_file", ERRORS["ENOSPC"], when=lambda *a, **k: calls.append(1) or len(calls) == 2)


@pytest.mark.parametrize("device_map", [None, "cpu"])
def test_a_diffusers_pipeline_we_return_saves_atomically_placed_or_not(tmp_path, device_map):
    """Loaded without device_map, a diffusers pipeline kept diffusers' in-place save: a full disk after the first
    component left one seed's components beside another's, and the folder loaded without a word."""
    pytest.importorskip("diffusers")
    import safetensors.torch

    from test_diffusers_pipelines import build_flux

    for seed in (0, 1):
        torch.manual_seed(seed)
        build_flux(tmp_path / "parts").save_pretrained(tmp_path / f"seed{seed}")
    target = tmp_path / "saved"
    Pipeline.from_pretrained(tmp_path / "seed0", device_map=device_map, progress=False).save_pretrained(target)
    before = contents(target)
    other = Pipeline.from_pretrained(tmp_path / "seed1", device_map=device_map, progress=False)
    with _second_write_fails(safetensors.torch), pytest.raises(CheckpointSaveError, match=rf"'{target}'.*unchanged"):
        other.save_pretrained(target)
    assert contents(target) == before and hidden(tmp_path) == []
    other.transformer.save_pretrained(target / "transformer", variant="fp16")  # a component's save: atomic too
    assert (target / "transformer" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    other.save_pretrained(target, variant="fp16")  # diffusers passes the variant on to each component's save
    assert (target / "vae" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert contents(target)[Path("vae/diffusion_pytorch_model.safetensors")] == before[
        Path("vae/diffusion_pytorch_model.safetensors")]  # the default variant, carried over


@pytest.mark.parametrize("device_map", [None, "auto"])
def test_a_model_load_model_returns_saves_atomically_over_another_version(tmp_path, device_map):
    diffusers = pytest.importorskip("diffusers")
    import copy
    import pickle

    import safetensors.torch

    from pipelines import load_model

    config = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    for seed in (0, 1):
        torch.manual_seed(seed)
        diffusers.FluxTransformer2DModel(**config).save_pretrained(tmp_path / f"seed{seed}", max_shard_size="20KB")
    target = tmp_path / "saved"
    load_model(tmp_path / "seed0", device_map=device_map, progress=False).save_pretrained(target, max_shard_size="20KB")
    (target / "README.md").write_text("mine")
    before = contents(target)
    other = load_model(tmp_path / "seed1", device_map=device_map, progress=False)
    with _second_write_fails(safetensors.torch), pytest.raises(CheckpointSaveError, match=rf"'{target}'.*unchanged"):
        other.save_pretrained(target, max_shard_size="20KB")  # diffusers writes one shard after another
    assert contents(target) == before and hidden(tmp_path) == []
    other.save_pretrained(target)  # one file now: the old shards and index go, the README stays
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "config.json",
                                                        "diffusion_pytorch_model.safetensors"]
    assert copy.deepcopy(other).save_pretrained.obj is not other
    if device_map is None:  # the atomic save is no obstacle to pickling (accelerate's hooks are, placed)
        assert isinstance(pickle.loads(pickle.dumps(other)), diffusers.FluxTransformer2DModel)

"""Nothing lost, nothing changed behind the user's back (issue 42): saves of what the library hands out are atomic
whether placed or not, the CLI's files are written whole, `placement run` never writes through a link nor replaces
another run's images, disk-homed weights stay the version loaded, and cut or foreign GGUF and LoRA files are named."""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from bad_input_models import FLUX, tiny_flux_pipeline, tiny_pipeline
from cases_calls import CLI, cli
from cases_first_hour import RUN, with_tiny_flux
from catalogue import Case

FOLDER_ERROR = "pipelines.errors.FolderError"
SAVE_ERROR = "pipelines.errors.CheckpointSaveError"
CHANGED = "hooks.errors.OffloadConflictError"
IDS = torch.tensor([[1, 2, 3]])
VIRTUAL = "PLACEMENT_VIRTUAL_ACCELERATORS"


def _contents(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@contextmanager
def _safetensors_write_fails(number: int):
    import safetensors.torch

    original, calls = safetensors.torch.save_file, []

    def save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    safetensors.torch.save_file = save_file
    try:
        yield
    finally:
        safetensors.torch.save_file = original


def _over_another_version(load, failing: int):
    """Save version 0 of a tiny FLUX (loaded by `load`) to {tmp}/saved, then another version over it on a full disk
    (the `failing`-th weights file written fails)."""
    def run(tmp: Path):
        import diffusers

        tiny_flux_pipeline(tmp / "seed0")
        other = diffusers.FluxPipeline.from_pretrained(tmp / "seed0")
        with torch.no_grad():
            for module in (other.transformer, other.vae):
                for parameter in module.parameters():
                    parameter.add_(1.0)
        other.save_pretrained(tmp / "seed1")
        load(tmp / "seed0").save_pretrained(tmp / "saved")
        (tmp / "before").write_text(repr(sorted(_contents(tmp / "saved").items())))
        with _safetensors_write_fails(failing):
            load(tmp / "seed1").save_pretrained(tmp / "saved")
    return run


def _saved_folder_changed(tmp: Path) -> bool:
    return (tmp / "before").read_text() != repr(sorted(_contents(tmp / "saved").items()))


def _unplaced_pipeline(folder: Path):
    from pipelines import Pipeline

    return Pipeline.from_pretrained(folder, device_map=None, progress=False)


def _unplaced_model(folder: Path):
    from pipelines import load_model

    return load_model(folder / "transformer", device_map=None, progress=False)


def _previous_plan_kept(tmp: Path) -> bool:
    return (tmp / "plan.json").read_text() != "the previous plan\n"


@contextmanager
def _plan_json_disk_full(tmp: Path):
    (tmp / "plan.json").write_text("the previous plan\n")
    real = os.fdopen

    class HalfWritten:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.file, name)

    os.fdopen = lambda *args, **kwargs: HalfWritten(real(*args, **kwargs))
    try:
        yield
    finally:
        os.fdopen = real


def _plan_json_on_a_full_disk(tmp: Path):
    with _plan_json_disk_full(tmp):
        return cli("plan", "{pipe}", "--max-memory", "cpu=1GiB", "--json", "{tmp}/plan.json")(tmp)


def _lock_is(make):
    def before(tmp: Path):
        (tmp / "precious.txt").write_text("keep me")
        (tmp / "images").mkdir()
        make(tmp, tmp / "images" / ".placement-run.lock")
    return before


def _precious_changed(tmp: Path) -> bool:
    return (tmp / "precious.txt").read_text() != "keep me"


def _made_for_other_prompts(tmp: Path) -> None:
    cli(*RUN, "--out", "{tmp}/images")(tmp)
    (tmp / "before").write_text(repr(sorted(_contents(tmp / "images").items())))
    (tmp / "prompts.txt").write_text("a lighthouse\na blue whale\n")


def _images_replaced(tmp: Path) -> bool:
    return (tmp / "before").read_text() != repr(sorted(_contents(tmp / "images").items()))


def _gguf(damage):
    def run(tmp: Path):
        import sys

        import diffusers
        import pipelines

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines" / "loading"))
        from quantized_models import write_gguf

        torch.manual_seed(0)
        diffusers.FluxTransformer2DModel(**FLUX).save_pretrained(tmp / "flux")
        path = write_gguf(diffusers.FluxTransformer2DModel.from_pretrained(tmp / "flux").state_dict(),
                          tmp / "f.gguf", "Q8_0")
        path.write_bytes(damage(path.read_bytes()))
        return pipelines.load_model(path, config=tmp / "flux", progress=False)
    return run


def _disk_homed(change, *, links: bool):
    """Version 0 loaded with its decoder homed on disk, `change(tmp)` to the folder, then a call."""
    def run(tmp: Path):
        from pipelines import Pipeline

        tiny_pipeline(0).save_pretrained(tmp / "pipe")
        real, virtual = os.link, os.environ.get(VIRTUAL)
        if not links:  # an offload folder on another filesystem
            os.link = lambda *args, **kwargs: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device link"))
        os.environ[VIRTUAL] = "1"  # disk-homed weights run on an accelerator (on none, everything is on the CPU)
        try:
            pipe = Pipeline.from_pretrained(tmp / "pipe", device_map={"encoder": 0, "decoder": "disk"},
                                            offload_folder=tmp / "offload", progress=False)
            assert pipe.hf_device_map["decoder"] == "disk"
            expected = tiny_pipeline(0)
            (tmp / "expected").write_text(repr(expected.decoder(expected.encoder(IDS)).tolist()))
            change(tmp)
            (tmp / "got").write_text(repr(pipe.decoder(pipe.encoder(IDS)).cpu().tolist()))
        finally:
            os.link = real
            if virtual is None:
                os.environ.pop(VIRTUAL)
            else:
                os.environ[VIRTUAL] = virtual
    return run


def _saved_over(tmp: Path) -> None:
    tiny_pipeline(1).save_pretrained(tmp / "pipe")


def _computed_another_version(tmp: Path) -> bool:
    return (tmp / "got").exists() and (tmp / "got").read_text() != (tmp / "expected").read_text()


def _unplaced_lora(make):
    """A LoRA made by `make(folder)` loaded into a FLUX pipeline loaded without device_map (issue 42's gap: it got
    diffusers' raw error where a placed pipeline got ours); whether the transformer's keys changed is written down."""
    def run(tmp: Path):
        from pipelines import Pipeline

        folder = tiny_flux_pipeline(tmp / "flux")
        pipe = Pipeline.from_pretrained(folder, progress=False)
        make(tmp / "lora")
        keys = sorted(pipe.transformer.state_dict())
        try:
            pipe.load_lora_weights(tmp / "lora", adapter_name="bad")
        finally:
            (tmp / "keys-changed").write_text(str(sorted(pipe.transformer.state_dict()) != keys))
    return run


def _lora_cut_in_half(folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({f"transformer.single_transformer_blocks.0.attn.to_q.lora_{ab}.weight": torch.zeros(4, 16)
               for ab in "AB"}, str(folder / "pytorch_lora_weights.safetensors"))
    data = (folder / "pytorch_lora_weights.safetensors").read_bytes()
    (folder / "pytorch_lora_weights.safetensors").write_bytes(data[: len(data) // 2])


def _lora_of_no_layer(folder: Path) -> None:
    import diffusers

    diffusers.FluxPipeline.save_lora_weights(folder, transformer_lora_layers={
        f"single_transformer_blocks.0.no_such_layer.lora_{ab}.weight": torch.zeros(4, 4) for ab in "AB"})


def _pipeline_changed(tmp: Path) -> bool:
    return (tmp / "keys-changed").read_text() != "False"


CASES = [
    Case(name="formats: a LoRA cut in half on a pipeline loaded without device_map",
         run=_unplaced_lora(_lora_cut_in_half), error=FOLDER_ERROR,
         words=("load_lora_weights(", "lora'", "cannot be read", "cut short", "unchanged"), harm=_pipeline_changed),
    Case(name="formats: a LoRA whose keys adapt no layer on a pipeline loaded without device_map",
         run=_unplaced_lora(_lora_of_no_layer), error=FOLDER_ERROR,
         words=("load_lora_weights(", "lora'", "adapt no layer", "unchanged"), harm=_pipeline_changed),
    Case(name="save: full disk saving a diffusers pipeline loaded without device_map over another version",
         run=_over_another_version(_unplaced_pipeline, 2), error=SAVE_ERROR, words=("No space left", "unchanged"),
         harm=_saved_folder_changed),
    Case(name="save: full disk saving load_model(...) over another version",
         run=_over_another_version(_unplaced_model, 1), error=SAVE_ERROR, words=("No space left", "unchanged"),
         harm=_saved_folder_changed),
    Case(name="cli: plan --json on a full disk over a previous plan", run=_plan_json_on_a_full_disk,
         error=CLI, words=("Cannot write", "plan.json", "No space left", "unchanged"), harm=_previous_plan_kept),
    Case(name="cli: run whose lock file is a symlink to a file outside --out",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images",
                           before=_lock_is(lambda tmp, lock: lock.symlink_to(tmp / "precious.txt"))),
         error=CLI, words=("symbolic link", "never opens anything else"), harm=_precious_changed),
    Case(name="cli: run whose lock file is a folder",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", before=_lock_is(lambda tmp, lock: lock.mkdir())),
         error=CLI, words=("is a folder", "choose another --out")),
    Case(name="cli: run --wait with other prompts into a finished folder",
         run=with_tiny_flux(*RUN, "--out", "{tmp}/images", "--wait", before=_made_for_other_prompts),
         error=CLI, words=("other prompts", "'a red fox' (now 'a blue whale')", "--overwrite"), harm=_images_replaced),
    Case(name="formats: a .gguf file cut in half", run=_gguf(lambda data: data[: len(data) // 2]),
         error=FOLDER_ERROR, words=("f.gguf", "corrupt, truncated")),
    Case(name="formats: a random file named .gguf", run=_gguf(lambda data: bytes(range(256)) * 8),
         error=FOLDER_ERROR, words=("f.gguf", "not a GGUF file", "magic")),
    Case(name="runtime: a disk-homed folder saved over while placed keeps its version",
         run=_disk_homed(_saved_over, links=True), error=None, harm=_computed_another_version),
    Case(name="runtime: a disk-homed folder saved over, no link possible", run=_disk_homed(_saved_over, links=False),
         error=CHANGED, words=("decoder", "changed under the placed model", "Load the pipeline"),
         harm=_computed_another_version),
    Case(name="runtime: a disk-homed file deleted, no link possible",
         run=_disk_homed(lambda tmp: next((tmp / "pipe" / "decoder").glob("*.safetensors")).unlink(), links=False),
         error=CHANGED, words=("decoder", "it is gone")),
]

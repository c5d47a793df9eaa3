"""Bad inputs about folders: saving over things, folders naming code or outside files, broken index and configs,
odd checkpoint tensors, I/O failures."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from bad_input_models import (
    CatalogueEncoder,
    CatalogueEncoderConfig,
    CataloguePipeline,
    NoLoader,
    tiny_flux_pipeline,
    tiny_flux_transformer,
    tiny_pipeline,
    wrong_rank_lora,
)
from catalogue import Case
from safetensors.torch import load_file, save_file

import pipelines
from pipelines import Pipeline

CHECKPOINT = "pipelines.checkpoint"
INDEX_ERROR = "pipelines.errors.FolderError"
UNTRUSTED = "pipelines.errors.UntrustedClassError"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def saved(tmp: Path, **save_options) -> Path:
    folder = tmp / "pipe"
    tiny_pipeline().save_pretrained(folder, **save_options)
    return folder


def edit_json(path: Path, change) -> None:
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))


def with_index_entry(key, value):
    def run(tmp: Path):
        folder = saved(tmp)
        edit_json(folder / "model_index.json", lambda content: content.__setitem__(key, value))
        return Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})
    return run


def with_config(change, **load_options):
    def run(tmp: Path):
        folder = tmp / "enc"
        CatalogueEncoder(CatalogueEncoderConfig()).save_pretrained(folder)
        edit_json(folder / "config.json", change)
        return CatalogueEncoder.from_pretrained(folder, **load_options)
    return run


def with_tensor(name: str, make, **load_options):
    def run(tmp: Path):
        folder = tmp / "enc"
        CatalogueEncoder(CatalogueEncoderConfig()).save_pretrained(folder)
        tensors = load_file(folder / WEIGHTS)
        tensors[name] = make(tensors[name])
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
        return CatalogueEncoder.from_pretrained(folder, **load_options)
    return run


def sharded_with_weight_map(file_name: str):
    def run(tmp: Path):
        folder = tmp / "a" / "b" / "enc"
        CatalogueEncoder(CatalogueEncoderConfig()).save_pretrained(folder, max_shard_size=200)
        index = folder / "diffusion_pytorch_model.safetensors.index.json"
        shard = sorted(folder.glob("*-of-*"))[0]
        (tmp / "elsewhere").mkdir(exist_ok=True)
        (tmp / "elsewhere" / "x.safetensors").write_bytes(shard.read_bytes())
        edit_json(index, lambda content: content["weight_map"].update(
            {name: file_name for name, file in content["weight_map"].items() if file == shard.name}))
        return CatalogueEncoder.from_pretrained(folder)
    return run


# ---- saving ---------------------------------------------------------------------------------------------------

def save_over_user_files(tmp: Path):
    (tmp / "pipe" / "data").mkdir(parents=True)
    for name in ("README.md", "train.py", "data/set.csv"):
        (tmp / "pipe" / name).write_text("mine")
    tiny_pipeline().save_pretrained(tmp / "pipe")


def user_files_lost(tmp: Path) -> bool:
    return not all((tmp / "pipe" / name).is_file() for name in ("README.md", "train.py", "data/set.csv"))


def save_variant_over_default(tmp: Path):
    tiny_pipeline(seed=1).save_pretrained(saved(tmp), variant="fp16")


def default_weights_lost(tmp: Path) -> bool:
    try:
        CataloguePipeline.from_pretrained(tmp / "pipe")
    except Exception:  # noqa: BLE001
        return True
    return False


def save_to_regular_file(save):
    def run(tmp: Path):
        (tmp / "notes.txt").write_text("keep")
        save(tmp / "notes.txt")
    return run


def file_replaced(tmp: Path) -> bool:
    return not (tmp / "notes.txt").is_file()


@contextmanager
def working_folder(folder: Path):
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def save_into_working_folder(pipeline_level: bool):
    def run(tmp: Path):
        folder = saved(tmp)
        (folder / "train.py").write_text("mine")
        with working_folder(folder):
            obj = tiny_pipeline() if pipeline_level else tiny_pipeline().encoder
            obj.save_pretrained(".")
    return run


def working_folder_moved(tmp: Path) -> bool:
    return not (tmp / "pipe" / "train.py").is_file() or hidden_left(tmp)


def hidden_left(tmp: Path) -> bool:
    return any(path.name.startswith(".") for path in tmp.rglob("*"))


def failing(module_path: str, attribute: str, error: OSError, *, when=lambda *args: True):
    """Patch `module_path.attribute` to raise `error` (when `when(*args)`), for the duration of a case."""
    @contextmanager
    def patched():
        module = __import__(module_path, fromlist=["_"])
        original = getattr(module, attribute)

        def replacement(*args, **kwargs):
            if when(*args):
                raise error
            return original(*args, **kwargs)

        setattr(module, attribute, replacement)
        try:
            yield
        finally:
            setattr(module, attribute, original)
    return patched


def full_disk_save(pipeline_level: bool):
    def run(tmp: Path):
        folder = saved(tmp)
        with failing("pipelines.checkpoint.saving", "save_file", OSError(28, "No space left on device"))():
            obj = tiny_pipeline(seed=1) if pipeline_level else tiny_pipeline(seed=1).encoder
            obj.save_pretrained(folder if pipeline_level else folder / "encoder")
    return run


def failing_swap(tmp: Path):
    folder = saved(tmp)
    staging = lambda source, *rest: ".saving-" in str(source)  # noqa: E731
    error = OSError(5, "Input/output error")
    atomic = _optional_module("pipelines.checkpoint.saving")
    exchange = getattr(atomic, "_exchange", None)
    if atomic is not None:
        atomic._exchange = lambda first, second: False
    try:
        with failing("os", "rename", error, when=staging)(), failing("os", "replace", error, when=staging)():
            tiny_pipeline(seed=1).save_pretrained(folder)
    finally:
        if atomic is not None:
            atomic._exchange = exchange


def _optional_module(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        return None


def old_pipeline_lost(tmp: Path) -> bool:
    return hidden_left(tmp) or default_weights_lost(tmp)


# ---- folders that name code ----------------------------------------------------------------------------------

def evil_folder(tmp: Path, entry_point: str):
    package = tmp / "site" / "evilpipe_catalogue" / "vae"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text(f"open({str(tmp / 'marker')!r}, 'w').write('ran')\nclass VAE:\n    pass\n")
    folder = saved(tmp)
    edit_json(folder / "model_index.json", lambda c: c.__setitem__("decoder", ["evilpipe_catalogue.vae", "VAE"]))
    import sys
    sys.path.insert(0, str(tmp / "site"))
    try:
        if entry_point == "plan":
            return Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})
        return Pipeline.from_pretrained(folder)
    finally:
        sys.path.remove(str(tmp / "site"))
        for name in [n for n in sys.modules if n.startswith("evilpipe_catalogue")]:
            del sys.modules[name]


def code_ran(tmp: Path) -> bool:
    return (tmp / "marker").exists()


def no_loader_class(tmp: Path):
    if hasattr(pipelines, "register_class"):
        pipelines.register_class(NoLoader)
    folder = saved(tmp)
    (folder / "noloader").mkdir()
    edit_json(folder / "model_index.json", lambda c: c.__setitem__("noloader", [NoLoader.__module__, "NoLoader"]))
    return Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})


def io_error_during_load(tmp: Path):
    folder = saved(tmp)
    import safetensors
    original = safetensors.safe_open

    class FailingHandle:
        def __init__(self, *args, **kwargs):
            self._handle = original(*args, **kwargs)

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def get_tensor(self, name):
            raise OSError(5, "Input/output error")

        def __getattr__(self, name):
            return getattr(self._handle, name)

    loading = __import__("pipelines.checkpoint.streaming", fromlist=["_"])
    loading.safe_open = FailingHandle
    try:
        return CataloguePipeline.from_pretrained(folder, device_map="cpu")
    finally:
        loading.safe_open = original


def model_to_disk_without_offload_folder(tmp: Path):
    folder = tmp / "enc"
    CatalogueEncoder(CatalogueEncoderConfig()).save_pretrained(folder)
    return CatalogueEncoder.from_pretrained(folder, device_map="auto", max_memory={0: "100B", "cpu": "100B"})


CASES = [
    Case(name="save: pipeline into a folder holding README.md, train.py, data/", run=save_over_user_files,
         error=None, harm=user_files_lost),
    Case(name="save: variant fp16 into a pipeline folder", run=save_variant_over_default, error=None,
         harm=default_weights_lost),
    Case(name="save: pipeline to a path that is a regular file",
         run=save_to_regular_file(lambda path: tiny_pipeline().save_pretrained(path)),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("not a folder",), harm=file_replaced),
    Case(name="save: model to a path that is a regular file",
         run=save_to_regular_file(lambda path: tiny_pipeline().encoder.save_pretrained(path)),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("not a folder",), harm=file_replaced),
    Case(name="save: model to '.' inside that folder", run=save_into_working_folder(False),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("working folder",), harm=working_folder_moved),
    Case(name="save: pipeline to '.' inside that folder", run=save_into_working_folder(True),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("working folder",), harm=working_folder_moved),
    Case(name="save: full disk during a pipeline save", run=full_disk_save(True),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("No space left",), harm=old_pipeline_lost),
    Case(name="save: full disk during a model save", run=full_disk_save(False),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("No space left",), harm=old_pipeline_lost),
    Case(name="save: the final rename fails", run=failing_swap,
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("unchanged",), harm=old_pipeline_lost),
    Case(name="trust: from_pretrained of a folder naming evilpipe.vae", run=lambda tmp: evil_folder(tmp, "load"),
         error=UNTRUSTED, words=("evilpipe_catalogue.vae", "trust_remote_code"), harm=code_ran),
    Case(name="trust: plan_placement of a folder naming evilpipe.vae", run=lambda tmp: evil_folder(tmp, "plan"),
         error=UNTRUSTED, words=("evilpipe_catalogue.vae", "trust_remote_code"), harm=code_ran),
    Case(name="trust: a non-module class without from_pretrained", run=no_loader_class,
         error="pipelines.errors.FolderError", words=("noloader", "from_pretrained")),
    Case(name="paths: weight_map entry ../../../elsewhere/x.safetensors",
         run=sharded_with_weight_map("../../../elsewhere/x.safetensors"),
         error="pipelines.errors.FolderError", words=("not plain file names",), harm_if_accepted=True),
    Case(name="paths: weight_map entry ../../../../etc/passwd",
         run=sharded_with_weight_map("../../../../../../../../etc/passwd"),
         error="pipelines.errors.FolderError", words=("not plain file names",), harm_if_accepted=True),
    Case(name="paths: weight_map entry an absolute path", run=sharded_with_weight_map("/etc/hostname"),
         error="pipelines.errors.FolderError", words=("not plain file names",), harm_if_accepted=True),
    Case(name="paths: component named ../encoder in model_index.json",
         run=lambda tmp: _rename_component(tmp, "../encoder"),
         error="pipelines.errors.FolderError", words=("not a plain folder name",)),
    Case(name="index: component entry with one element", run=with_index_entry("encoder", ["pipelines"]),
         error=INDEX_ERROR, words=("'encoder'", "[library, ClassName]")),
    Case(name="index: component entry of integers", run=with_index_entry("encoder", [1, 2]),
         error=INDEX_ERROR, words=("'encoder'", "two strings")),
    Case(name="index: component entry half null", run=with_index_entry("encoder", ["pipelines", None]),
         error=INDEX_ERROR, words=("'encoder'", "[null, null]")),
    Case(name="index: _class_name an integer", run=with_index_entry("_class_name", 5),
         error=INDEX_ERROR, words=("_class_name", "string")),
    Case(name="index: _model_graph a string", run=with_index_entry("_model_graph", "encoder->decoder"),
         error=INDEX_ERROR, words=("_model_graph", "[producer, consumer]")),
    Case(name="index: _model_graph edge of one name", run=with_index_entry("_model_graph", [["encoder"]]),
         error=INDEX_ERROR, words=("_model_graph", "[producer, consumer]")),
    Case(name="index: unknown library class name", run=with_index_entry("encoder", ["pipelines", "NoSuchModel"]),
         error=INDEX_ERROR, words=("'encoder'", "NoSuchModel")),
    Case(name="config: true for an int field", run=with_config(lambda c: c.__setitem__("width", True)),
         error="pipelines.errors.FolderError", words=("'width'", "integer")),
    Case(name="config: 8.0 for an int field", run=with_config(lambda c: c.__setitem__("width", 8.0)),
         error="pipelines.errors.FolderError", words=("'width'", "integer")),
    Case(name="config: unknown field", run=with_config(lambda c: c.__setitem__("widht", 8)),
         error="pipelines.errors.FolderError", words=("unknown field 'widht'",)),
    Case(name="config: a string for an int field", run=with_config(lambda c: c.__setitem__("vocab", "many")),
         error="pipelines.errors.FolderError", words=("'vocab'",)),
    Case(name="weights: one float16 parameter among float32", run=with_tensor("proj.weight", lambda t: t.half()),
         error="pipelines.errors.FolderError", words=("proj.weight", "torch_dtype")),
    Case(name="weights: int32 tensor for an int64 buffer", run=with_tensor("position_ids", lambda t: t.int()),
         error="pipelines.errors.FolderError", words=("position_ids", "int32", "int64")),
    Case(name="weights: float tensor for an int64 buffer", run=with_tensor("position_ids", lambda t: t.float()),
         error="pipelines.errors.FolderError", words=("position_ids",)),
    Case(name="weights: wrong shape", run=with_tensor("proj.weight", lambda t: t[:4]),
         error=f"{CHECKPOINT}.CheckpointShapeError", words=("proj.weight",)),
    Case(name="weights: integer torch_dtype at model level", run=with_tensor("proj.weight", lambda t: t, torch_dtype=16),
         error="placement.errors.PlanError", words=("torch_dtype", "16")),
    Case(name="weights: misspelt string torch_dtype at model level",
         run=with_tensor("proj.weight", lambda t: t, torch_dtype="float61"),
         error="placement.errors.PlanError", words=("float61",)),
    Case(name="load: a model planned to disk without offload_folder", run=model_to_disk_without_offload_folder,
         error="placement.errors.PlacementError", words=("offload_folder",)),
    Case(name="weights: I/O error while reading a tensor", run=io_error_during_load,
         error=f"{CHECKPOINT}.WeightsNotFoundError", words=("Input/output error",)),
]


# ---- absurd configs, refused before any work (issue 30) --------------------------------------------------------

def configs_only_with(component: str, **changes):
    """Plan a configs-only copy of the catalogue pipeline whose `component` config.json has `changes`."""
    def run(tmp: Path):
        folder = saved(tmp)
        for weights in folder.rglob("*.safetensors"):
            weights.unlink()
        edit_json(folder / component / "config.json", lambda content: content.update(changes))
        return Pipeline.plan_placement(folder, max_memory={0: "24GiB", "cpu": "64GiB"})
    return run


def nested_without_end(file_name: str):
    def run(tmp: Path):
        folder = saved(tmp)
        (folder / file_name).write_text("[" * 100_000 + "]" * 100_000)
        return Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})
    return run


# ---- saves: every writer's error ---------------------------------------------------------------------------------

def write_error_in(module_path: str, attribute: str, error: OSError, when=lambda *args: True):
    def run(tmp: Path):
        folder = saved(tmp)
        (folder / "README.md").write_text("mine")
        with failing("os", "link", OSError(18, "Invalid cross-device link"))():  # carried over by copies
            with failing(module_path, attribute, error, when=when)():
                tiny_pipeline(seed=1).save_pretrained(folder)
    return run


def readme_or_pipeline_lost(tmp: Path) -> bool:
    return not (tmp / "pipe" / "README.md").is_file() or old_pipeline_lost(tmp)


# ---- formats: quantization configs, single files, special files, adapters, pickles --------------------------------

def quantized_folder(value):
    def run(tmp: Path):
        folder = tiny_flux_transformer(tmp / "flux")
        edit_json(folder / "config.json", lambda content: content.__setitem__("quantization_config", value))
        return pipelines.load_model(folder, device_map=None, progress=False)
    return run


def single_file_with_half_its_keys(tmp: Path):
    folder = tiny_flux_transformer(tmp / "flux")
    tensors = load_file(folder / WEIGHTS)
    save_file(dict(sorted(tensors.items())[: len(tensors) // 2]), tmp / "half.safetensors")
    return pipelines.load_model(tmp / "half.safetensors", config=folder, progress=False)


def weights_file_replaced(make):
    def run(tmp: Path):
        folder = saved(tmp)
        weights = folder / "encoder" / WEIGHTS
        weights.unlink()
        make(weights)
        return CataloguePipeline.from_pretrained(folder, device_map="cpu")
    return run


def lora_of_the_wrong_rank(tmp: Path):
    import diffusers

    folder = tiny_flux_pipeline(tmp / "flux")
    wrong_rank_lora(diffusers.FluxTransformer2DModel.from_pretrained(folder / "transformer"), tmp / "lora")
    pipe = Pipeline.from_pretrained(folder, device_map="balanced", max_memory={"cpu": "1GiB"}, progress=False)
    keys = sorted(pipe.transformer.state_dict())
    try:
        pipe.load_lora_weights(tmp / "lora", adapter_name="wrong")
    finally:
        (tmp / "keys-changed").write_text(str(sorted(pipe.transformer.state_dict()) != keys))


def pipeline_changed(tmp: Path) -> bool:
    return (tmp / "keys-changed").read_text() != "False"


def pickle_only_transformers_component(device_map):
    def run(tmp: Path):
        import transformers

        encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
            hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=1, vocab_size=64,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1))
        folder = saved(tmp)
        shutil.rmtree(folder / "encoder")
        encoder.config.architectures = ["CLIPTextModel"]
        encoder.config.save_pretrained(folder / "encoder")
        torch.save(encoder.state_dict(), folder / "encoder" / "pytorch_model.bin")
        edit_json(folder / "model_index.json", lambda c: c.__setitem__("encoder", ["transformers", "CLIPTextModel"]))
        return Pipeline.from_pretrained(folder, generic=True, device_map=device_map, progress=False)
    return run


def deleted_weights_plan(tmp: Path):
    folder = saved(tmp)
    (folder / "decoder" / WEIGHTS).unlink()
    return Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})


def tiny_flux_configs_only(tmp: Path, **changes):
    """Plan a configs-only tiny-flux whose transformer's config.json has `changes` (repeated blocks)."""
    from bad_input_models import tiny_flux_preset

    folder = tiny_flux_preset(tmp / "tiny-flux")
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    edit_json(folder / "transformer" / "config.json", lambda content: content.update(changes))
    return Pipeline.plan_placement(folder, max_memory={0: "24GiB", "cpu": "64GiB"})


QUANTIZATION = "pipelines.errors.LoadError"
HUGE = 10**12
CASES += [
    Case(name="limits: a config.json of 1e12 layers",
         run=lambda tmp: tiny_flux_configs_only(tmp, num_single_layers=HUGE),
         error="pipelines.errors.FolderError", words=(f"num_single_layers={HUGE}", "the limit is 10000")),
    Case(name="limits: a config.json 1e12 wide", run=configs_only_with("encoder", width=HUGE),
         error="placement.errors.DoesNotFitError", words=(f"width={HUGE}", "more than all budgets together")),
    Case(name="limits: model_index.json nested 100000 deep", run=nested_without_end("model_index.json"),
         error=INDEX_ERROR, words=("model_index.json", "more than 64 levels")),
    Case(name="limits: config.json nested 100000 deep", run=nested_without_end("encoder/config.json"),
         error="pipelines.errors.FolderError", words=("config.json", "more than 64 levels")),
    Case(name="save: file too large from the JSON writer",
         run=write_error_in("os", "replace", OSError(27, "File too large"),
                            when=lambda source, *rest: ".saving-" in str(source)),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("File too large", "unchanged"),
         harm=readme_or_pipeline_lost),
    Case(name="save: I/O error copying a carried-over README",
         run=write_error_in("shutil", "copy2", OSError(5, "Input/output error")),
         error=f"{CHECKPOINT}.CheckpointSaveError", words=("Input/output error", "unchanged"),
         harm=readme_or_pipeline_lost),
    Case(name="formats: quantization_config 'int8' (a string) in config.json", run=quantized_folder("int8"),
         error=QUANTIZATION, words=("'int8'", "not a quantization config", "'torchao'")),
    Case(name="formats: an unknown quant_method in config.json", run=quantized_folder({"quant_method": "int3"}),
         error=QUANTIZATION, words=("quant_method='int3'", "accepted values")),
    Case(name="formats: a torchao quantization_config without its type",
         run=quantized_folder({"quant_method": "torchao"}), error=QUANTIZATION, words=("'quant_type'",)),
    Case(name="formats: bitsandbytes load_in_4bit and load_in_8bit both",
         run=quantized_folder({"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True}),
         error=QUANTIZATION, words=("load_in_4bit and load_in_8bit",)),
    Case(name="formats: a single file with half its keys", run=single_file_with_half_its_keys,
         error="pipelines.errors.LoadError", words=("half.safetensors", "missing")),
    Case(name="formats: a FIFO as the weights file", run=weights_file_replaced(os.mkfifo),
         error="pipelines.errors.FolderError", words=(WEIGHTS, "a FIFO", "not a regular file")),
    Case(name="formats: /dev/zero as the weights file",
         run=weights_file_replaced(lambda path: path.symlink_to("/dev/zero")),
         error="pipelines.errors.FolderError", words=(WEIGHTS, "character device")),
    Case(name="formats: a LoRA of the wrong rank on a placed pipeline", run=lora_of_the_wrong_rank,
         error=f"{CHECKPOINT}.CheckpointShapeError", words=("lora", "size mismatch", "unchanged"),
         harm=pipeline_changed),
    Case(name="trust: a pickle-only component loaded without a device map",
         run=pickle_only_transformers_component(None), error=f"{CHECKPOINT}.WeightsNotFoundError",
         words=("pytorch_model.bin", "never unpickled", "use_safetensors=False"), harm_if_accepted=True),
    Case(name="trust: a pickle-only component loaded with a device map",
         run=pickle_only_transformers_component("balanced"), error=f"{CHECKPOINT}.WeightsNotFoundError",
         words=("pytorch_model.bin", "never unpickled"), harm_if_accepted=True),
    Case(name="plan: a local folder whose weights file was deleted", run=deleted_weights_plan,
         error=f"{CHECKPOINT}.WeightsNotFoundError",
         words=("cannot load as it is", "decoder: No weights in", "pipe/decoder", WEIGHTS)),
]


def _rename_component(tmp: Path, new_name: str):
    folder = saved(tmp)
    edit_json(folder / "model_index.json", lambda c: c.__setitem__(new_name, c.pop("encoder")))
    return Pipeline.plan_placement(folder, max_memory={"cpu": "1GiB"})


_ = torch  # tensors are made by the lambdas above

"""Bad inputs given to calls: placement.plan, from_pretrained, a pipeline call, and the `placement` command."""

from __future__ import annotations

import contextlib
import io
import json
from functools import lru_cache
from pathlib import Path

import torch
from bad_input_models import CataloguePipeline, tiny_pipeline
from catalogue import Case, CliFailure
from torch import nn

import placement
from pipelines import TextToImagePipeline

CALL_ERROR = "pipelines.errors.CallError"


def plan_of(components, **options):
    return lambda tmp: placement.plan(components, max_memory={"cpu": "1GiB"}, **options)


@lru_cache(maxsize=1)
def tiny_dit() -> TextToImagePipeline:
    return TextToImagePipeline.from_preset("tiny-dit", seed=0)


def call(**arguments):
    options = {"prompt": "a lighthouse", "height": 64, "width": 64, "num_inference_steps": 1, "output_type": "pt"}
    options.update(arguments)
    return lambda tmp: tiny_dit()(**options)


def load(**options):
    def run(tmp: Path):
        tiny_pipeline().save_pretrained(tmp / "pipe")
        return CataloguePipeline.from_pretrained(tmp / "pipe", **options)
    return run


def cli(*argv: str, folder_edit=None):
    """Run `placement ARGV` in-process; `{pipe}` / `{tmp}` in an argument are replaced by the paths."""
    def run(tmp: Path):
        from pipelines.cli import main

        folder = tmp / "pipe"
        tiny_pipeline().save_pretrained(folder)
        if folder_edit is not None:
            content = json.loads((folder / "model_index.json").read_text())
            folder_edit(content)
            (folder / "model_index.json").write_text(json.dumps(content))
        arguments = [arg.format(pipe=folder, tmp=tmp) for arg in argv]
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(arguments)
            except SystemExit as exit_:  # argparse
                code = exit_.code
        if code:
            raise CliFailure(int(code), stderr.getvalue())
    return run


def offloaded_to_half(tmp: Path):
    pipe = tiny_pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    pipe.to(torch.float16)


def plan_tiny_flux(**options):
    """Plan the tiny-flux preset's folder with `options` (two 24 GiB GPUs and 64 GiB of RAM)."""
    def run(tmp: Path):
        from bad_input_models import tiny_flux_preset
        from pipelines import Pipeline

        return Pipeline.plan_placement(tiny_flux_preset(tmp / "tiny-flux"),
                                       max_memory={0: "24GiB", 1: "24GiB", "cpu": "64GiB"}, **options)
    return run


def plan_wan_configs(call: dict):
    """Plan the configs of Wan 2.1 T2V 1.3B (its depth cut to one block, the real widths) for `call`."""
    def run(tmp: Path):
        import sys

        folders = str(Path(__file__).resolve().parents[1] / "pipelines")
        if folders not in sys.path:
            sys.path.insert(0, folders)
        from family_folders import write_configs_folder

        from pipelines import Pipeline

        folder = write_configs_folder(tmp / "wan", "wan2.1-t2v-1.3b")
        return Pipeline.plan_placement(folder, max_memory={0: "24GiB", "cpu": "64GiB"}, call=call)
    return run


def quantization_dict_for_a_model(tmp: Path):
    import pipelines
    from bad_input_models import tiny_flux_transformer

    folder = tiny_flux_transformer(tmp / "flux")
    return pipelines.plan_model(folder, max_memory={0: "1GiB"}, quantization_config={"quant_method": "int3"})


two = {"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}
CLI = "catalogue.CliFailure"

CASES = [
    Case(name="plan: misspelt dtype key", run=plan_of(two, dtype={"c": torch.float16}),
         error="placement.errors.PlanError", words=("'c'", "default")),
    Case(name="plan: component names colliding as strings", run=plan_of({1: nn.Linear(2, 2), "1": nn.Linear(2, 2)}),
         error="placement.errors.PlanError", words=("collide", "'1'")),
    Case(name="plan: a non-module component", run=plan_of({"a": nn.Linear(2, 2), "tok": "tokenizer"}),
         error="placement.errors.PlanError", words=("tok",)),
    Case(name="plan: malformed memory size", run=lambda tmp: placement.plan(two, max_memory={"cpu": "1Gx"}),
         error="placement.errors.PlanError", words=("1Gx",)),
    Case(name="plan: unknown strategy", run=plan_of(two, strategy="balnced"),
         error="placement.errors.PlanError", words=("balnced",)),
    Case(name="load: torch_dtype dict with a misspelt key", run=load(torch_dtype={"encodr": torch.float16}),
         error="placement.errors.PlanError", words=("encodr",)),
    Case(name="load: unknown component keyword", run=load(encodr=None),
         error="pipelines.errors.UnknownKeywordError", words=("encodr", "did you mean encoder?")),
    Case(name="load: a folder that does not exist",
         run=lambda tmp: CataloguePipeline.from_pretrained(tmp / "missing"),
         error="pipelines.checkpoint.WeightsNotFoundError", words=("missing",)),
    Case(name="load: a variant that does not exist", run=load(variant="fp16"),
         error="pipelines.checkpoint.WeightsNotFoundError", words=("fp16", "default")),
    Case(name="call: guidance_scale=inf", run=call(guidance_scale=float("inf")),
         error=CALL_ERROR, words=("guidance_scale", "inf")),
    Case(name="call: guidance_scale=nan", run=call(guidance_scale=float("nan")),
         error=CALL_ERROR, words=("guidance_scale",)),
    Case(name="call: guidance_scale as a string", run=call(guidance_scale="4"),
         error=CALL_ERROR, words=("guidance_scale", "'4'")),
    Case(name="call: prompt=None", run=call(prompt=None), error=CALL_ERROR, words=("prompt", "None")),
    Case(name="call: prompt a number", run=call(prompt=3), error=CALL_ERROR, words=("prompt",)),
    Case(name="call: height as a string", run=call(height="64"), error=CALL_ERROR, words=("height", "'64'")),
    Case(name="call: num_inference_steps=2.5", run=call(num_inference_steps=2.5), error=CALL_ERROR,
         words=("num_inference_steps", "2.5")),
    Case(name="call: height not a multiple of the VAE factor", run=call(height=65), error=CALL_ERROR,
         words=("height=65",)),
    Case(name="call: unknown output_type", run=call(output_type="gif"), error=CALL_ERROR, words=("gif",)),
    Case(name="cli: plan a folder with a malformed model_index entry",
         run=cli("plan", "{pipe}", folder_edit=lambda c: c.__setitem__("encoder", [1, 2])),
         error=CLI, words=("encoder",)),
    Case(name="cli: plan a folder with a malformed _model_graph",
         run=cli("plan", "{pipe}", folder_edit=lambda c: c.__setitem__("_model_graph", [["encoder"]])),
         error=CLI, words=("_model_graph",)),
    Case(name="cli: plan --json to a path below a regular file",
         run=cli("plan", "{pipe}", "--max-memory", "cpu=1GiB", "--json", "{pipe}/model_index.json/plan.json"),
         error=CLI, words=("cannot access", "model_index.json")),
    Case(name="cli: plan a folder that does not exist", run=cli("plan", "{tmp}/nothing-here"),
         error=CLI, words=("nothing-here",)),
    Case(name="cli: plan with a malformed --max-memory", run=cli("plan", "{pipe}", "--max-memory", "0=24Gx"),
         error=CLI, words=()),
    Case(name="cli: plan with a device given twice in --max-memory",
         run=cli("plan", "{pipe}", "--max-memory", "0=1GiB,0=2GiB"), error=CLI, words=("0",)),
    Case(name="plan: a component pinned to GPU 0 while max_memory lists no GPU",
         run=plan_of({"a": nn.Linear(2, 2)}, strategy={"a": 0}), error="placement.errors.PlacementError",
         words=("'a'", "0")),
    Case(name="call: .to(torch.float16) on a pipeline with model CPU offload", run=offloaded_to_half,
         error="hooks.errors.OffloadConflictError", words=("offload",)),
    Case(name="cli: plan a folder naming an untrusted class",
         run=cli("plan", "{pipe}", folder_edit=lambda c: c.__setitem__("decoder", ["evil_cli_module", "X"])),
         error=CLI, words=("evil_cli_module",)),
]
CASES += [
    Case(name="plan: call height=1000000, width=1000000", run=plan_tiny_flux(call={"height": 10**6, "width": 10**6}),
         error="placement.errors.DoesNotFitError", words=("height=1000000, width=1000000", "largest budget")),
    Case(name="plan: call max_sequence_length=1e12 (Wan)", run=plan_wan_configs({"max_sequence_length": 10**12}),
         error="placement.errors.DoesNotFitError", words=("max_sequence_length=1000000000000", "token ids")),
    Case(name="plan: call num_frames=1e8 (Wan)", run=plan_wan_configs({"height": 480, "width": 832,
                                                                       "num_frames": 10**8}),
         error="placement.errors.DoesNotFitError", words=("num_frames=100000000", "largest budget")),
    Case(name="plan: a quantization config dict with an unknown quant_method", run=quantization_dict_for_a_model,
         error="pipelines.errors.LoadError", words=("quant_method='int3'", "accepted values")),
]

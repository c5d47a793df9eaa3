"""`placement inspect TARGET`: what a pipeline is made of, before planning it.

TARGET is a preset name, a pipeline folder or a Hub id (only model_index.json and the configs are
downloaded). Every module component is built on meta (no memory, no weights read) and listed with its class,
its size per dtype (as saved, bf16/fp16, fp32), its largest unsplittable block (the smallest room a split
can use) and what it could run on with the budgets given (--max-memory) or detected: whole on one
accelerator, split over several, offloaded (streamed block by block), or only the CPU. The pipeline
counterpart of `accelerate estimate-memory`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .args import budgets_arg, dtype_arg, refused, target_problem, torch_dtype


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect", help="list a pipeline's components, sizes per dtype and what each could run on",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", help="a preset (flux, sdxl, sd35-large, tiny-flux, ...; see the README), a folder or a Hub id")
    parser.add_argument("--max-memory", type=budgets_arg, default=None, metavar="BUDGETS",
                        help="budgets to judge against, e.g. 2x24GiB or 0=24GiB,1=12GiB (default: detect)")
    parser.add_argument("--dtype", type=dtype_arg, default=None,
                        help="the dtype the 'could run on' column assumes (default: as saved)")
    parser.set_defaults(run=run, parser=parser)


@dataclass(frozen=True, kw_only=True)
class ComponentFacts:
    name: str
    class_name: str
    as_saved: str  # dtype name
    sizes: dict[str, int]  # dtype name -> bytes
    largest_block: int
    streamed: int  # what offloading keeps on the execution device at once
    runs_on: str


def run(args: argparse.Namespace) -> int:
    early = refused(args, target_problem(args.target))
    if early is not None:  # said before torch loads (seconds)
        return early

    from placement.budgets import resolve_budgets
    from placement.devices import device_label
    from placement.reports import aligned_columns  # the table layout of Plan.explain()
    from placement.sizes import format_bytes

    from .targets import in_flag_names, resolve_budgets_arg, warnings_once

    with warnings_once():
        budgets = resolve_budgets(resolve_budgets_arg(args.max_memory, "--max-memory"))
        modules, others = meta_components(args.target)
    facts = [component_facts(name, module, budgets, torch_dtype(args.dtype)) for name, module in modules.items()]
    dtypes = ["as saved", "bfloat16", "float32"]
    at = args.dtype or "as saved"
    header = ["component", "class", *dtypes, f"largest block ({at})", "offloaded, on the GPU at once",
              f"could run on ({at})"]
    rows = [[f.name, f.class_name, f"{format_bytes(f.sizes['as saved'])} ({f.as_saved})",
             format_bytes(f.sizes["bfloat16"]), format_bytes(f.sizes["float32"]), format_bytes(f.largest_block),
             format_bytes(f.streamed), f.runs_on] for f in facts]
    total = ["total", "", *[format_bytes(sum(f.sizes[d] for f in facts)) for d in dtypes], "", "", ""]
    print(f"{args.target}: {len(modules)} module components" + (f", and {', '.join(others)}" if others else ""))
    print("\n".join(aligned_columns(header, [*rows, total], left=2)))
    shown = ", ".join(f"{device_label(d)} {'unlimited' if b is None else format_bytes(b)}"
                      f"{' (detected)' if d in budgets.detected else ''}"
                      for d, b in budgets.limits.items() if d != "disk" or b is not None)
    budgets_text = args.max_memory.text if args.max_memory is not None else "0=24GiB,..."
    print(in_flag_names(
        f"\n'largest block': the largest piece a split cannot cut (the smallest room a split can use). "
        "'offloaded, on the GPU at once': the streaming working set. 'could run "
        f"on': judged against the budgets {shown}, weights only (runtime overhead and activations need a plan: "
        f"placement plan {args.target} --max-memory {budgets_text} --height H --width W). bfloat16 sizes hold "
        "for float16 too."))
    return 0


def meta_components(target: str):
    """{name: module on meta} for the module components, and the names of the others (tokenizers, ...)."""
    from ..folder.model_index import ModelIndex
    from ..folder.sources import component_sources
    from ..loading.meta import build_from_source
    from ..hf.quiet import quiet
    from .targets import hf_libraries, target_folder

    folder = target_folder(target)
    with quiet(preload=hf_libraries(folder)):
        sources = component_sources(ModelIndex.read(folder), folder, skip={})
        modules = {name: build_from_source(source, dtype=None, variant=None, weights_required=False).module
                   for name, source in sources.items() if source.is_module}
    return modules, [f"{name} ({source.cls.__name__})" for name, source in sources.items() if not source.is_module]


def component_facts(name: str, module, budgets, dtype) -> ComponentFacts:
    import torch

    from placement.sizing import size_module
    from placement.streaming import streaming_working_set

    own = next((t.dtype for t in module.parameters() if t.is_floating_point()), torch.float32)
    sizes = {"as saved": size_module(module).total, "bfloat16": size_module(module, torch.bfloat16).total,
             "float32": size_module(module, torch.float32).total}
    chosen = size_module(module, dtype)
    streamed = streaming_working_set(module, chosen)
    return ComponentFacts(
        name=name, class_name=type(module).__name__, as_saved=str(own).removeprefix("torch."), sizes=sizes,
        largest_block=chosen.largest_unit, streamed=streamed,
        runs_on=could_run_on(chosen.total, chosen.largest_unit, streamed, budgets),
    )


def could_run_on(total: int, largest_block: int, streamed: int, budgets) -> str:
    """The best placement kind this component could get alone, with these budgets (weights only)."""
    from placement.devices import device_label

    accelerators = {d: budgets.limit(d) for d in budgets.accelerators}
    whole = [device_label(d) for d, b in accelerators.items() if b is not None and b >= total]
    if whole:
        return "whole on " + ", ".join(whole)
    roomy = [b for b in accelerators.values() if b is not None and b >= largest_block]
    if len(roomy) > 1 and sum(roomy) >= total:
        return f"split over {len(roomy)} GPUs"
    if any(b is not None and b >= streamed for b in accelerators.values()):
        return "offloaded (streamed to a GPU)"
    cpu = budgets.limit("cpu")
    if cpu is None or cpu >= total:
        return "the CPU only"
    return "disk only (--offload-folder)"

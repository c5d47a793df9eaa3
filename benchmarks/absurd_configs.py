"""How long an absurd config or call takes to be refused (issue 30: under a second, before any heavy work).

    python benchmarks/absurd_configs.py

Each row plans a configs-only folder (the tiny-flux preset: diffusers' FluxPipeline; a FLUX transformer of
diffusers; a T5 encoder of transformers) with one absurd number, or a call of absurd size, against {0: 24GiB, cpu: 64GiB}, and prints the
error it ends with and the wall seconds from the call to the error (imports and the folder's writing excluded:
one warm-up plan runs first). Before the limits, the 1e12-layer configs built blocks for hours, the 1e12-wide
ones asked torch's CPU allocator for ~1 PB, and the 1e6 x 1e6 call estimated a tiled VAE decode for minutes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pipelines
from pipelines import Pipeline
from pipelines.presets.catalog import preset_folder

BUDGETS = {0: "24GiB", "cpu": "64GiB"}
HUGE = 10**12


def configs_only(source: Path, target: Path, config: str = "config.json", **changes) -> Path:
    shutil.copytree(source, target)
    for weights in target.rglob("*.safetensors"):
        weights.unlink()
    path = target / config
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return target


def sources(root: Path) -> dict[str, Path]:
    import diffusers
    import transformers

    shutil.copytree(preset_folder("tiny-flux"), root / "tiny-flux")
    diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                     pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).save_pretrained(root / "flux")
    transformers.T5EncoderModel(transformers.T5Config(vocab_size=64, d_model=64, d_ff=128, d_kv=16, num_layers=2,
                                                      num_heads=4)).save_pretrained(root / "t5")
    return {"tiny-flux": root / "tiny-flux", "flux": root / "flux", "t5": root / "t5"}


def cases(root: Path, found: dict[str, Path]) -> dict[str, callable]:
    def pipeline(name, **changes):
        folder = configs_only(found["tiny-flux"], root / name, "transformer/config.json", **changes)
        return lambda: Pipeline.plan_placement(folder, max_memory=BUDGETS)

    def model(source, name, **changes):
        folder = configs_only(found[source], root / name, **changes)
        return lambda: pipelines.plan_model(folder, max_memory=BUDGETS)

    def call(**sizes):
        return lambda: Pipeline.plan_placement(found["tiny-flux"], max_memory=BUDGETS, call=sizes)

    deep = configs_only(found["tiny-flux"], root / "deep", "transformer/config.json")
    (deep / "model_index.json").write_text("[" * 100_000 + "]" * 100_000)
    return {
        "tiny-flux num_single_layers=1e12": pipeline("layers", num_single_layers=HUGE),
        "tiny-flux joint_attention_dim=1e12": pipeline("wide", joint_attention_dim=HUGE),
        "FLUX (diffusers) num_layers=1e12": model("flux", "flux-layers", num_layers=HUGE),
        "FLUX (diffusers) attention_head_dim=1e12": model("flux", "flux-wide", attention_head_dim=HUGE),
        "T5 (transformers) num_layers=1e12": model("t5", "t5-layers", num_layers=HUGE),
        "T5 (transformers) d_model=1e12": model("t5", "t5-wide", d_model=HUGE),
        "call height=width=1e6": call(height=10**6, width=10**6),
        "call max_sequence_length=1e12": call(max_sequence_length=HUGE),
        "call num_images_per_prompt=1e8 at 1024x1024": call(height=1024, width=1024, num_images_per_prompt=10**8),
        "model_index.json nested 100000 deep": lambda: Pipeline.plan_placement(deep, max_memory=BUDGETS),
    }


def main() -> None:
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        found = sources(root)
        Pipeline.plan_placement(found["tiny-flux"], max_memory=BUDGETS)  # warm: imports, first-call caches
        pipelines.plan_model(found["flux"], max_memory=BUDGETS)
        pipelines.plan_model(found["t5"], max_memory=BUDGETS)
        print(f"{'case':44} {'seconds':>8}  refused with")
        for name, run in cases(root, found).items():
            start = time.perf_counter()
            try:
                run()
                outcome = "no error (!)"
            except Exception as error:  # noqa: BLE001 - the table reports whatever it ends with
                outcome = f"{type(error).__name__}: {str(error)[:90]}..."
            print(f"{name:44} {time.perf_counter() - start:8.3f}  {outcome}")


if __name__ == "__main__":
    main()

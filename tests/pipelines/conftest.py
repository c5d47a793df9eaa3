"""The shared fixtures of the pipelines tests (`checkpoint_models`, `pipeline_fixtures`, `family_folders`) live
here, beside the per-subpackage test folders that import them by name. A few tests also reuse the builders of
another folder's test module (`test_diffusers_pipelines.build_sd`, `test_virtual_accelerators.EVERY_KIND`,
`e2e/tiny_parts`'s tiny components): those folders are on the path too, so a test file runs alone as it runs in
the whole suite."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE / "hf", HERE / "loading", HERE / "e2e"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

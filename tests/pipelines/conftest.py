"""The shared fixtures of the pipelines tests (`checkpoint_models`, `pipeline_fixtures`, `family_folders`) live
here, beside the per-subpackage test folders that import them by name."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

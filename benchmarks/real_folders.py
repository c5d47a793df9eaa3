"""The real pipelines' configs-only folders, for the benchmarks that import this sibling script by name: the code
and the published configs live in the package (`pipelines.presets.real_folders`, its `data/` package data), where
the CLI's real presets (`placement plan flux`) write the same folders. One copy; this file only re-exports it."""

from pipelines.presets.real_folders import (  # noqa: F401  (re-exported)
    CLIP_LENGTH, DATA, PIPELINES, captured, clip_tokenizer, meta_pipeline, module_specs, shallow, t5_tokenizer,
    tokenizer_for, write_folder)

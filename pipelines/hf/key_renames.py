"""transformers checkpoints saved under their original key names: transformers 5 renames (and sometimes merges)
a checkpoint's tensors while loading (`conversion_mapping`: Qwen2.5-VL's `model.embed_tokens` becomes
`model.language_model.embed_tokens`, Llava and Mistral3 move their towers, ...) and writes the original names
back when saving. Such a checkpoint is read by transformers itself; this module only tells whether
transformers' own conversion explains why a checkpoint's keys differ from the model's (so a checkpoint that
is simply wrong still fails with the keys named, instead of loading with random weights).
"""

from __future__ import annotations

from typing import Iterable

from torch import nn


def renames_explain(module: nn.Module, checkpoint_keys: Iterable[str], *, allowed_missing: Iterable[str] = ()) -> bool:
    """Whether transformers' conversion mapping of `module`'s class turns `checkpoint_keys` into every tensor the
    module needs (`allowed_missing`: tied weights re-tied after loading). False when nothing is converted (the
    keys simply do not match) or the conversion API is not available."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return False
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = module.state_dict(keep_vars=True)
    prefix = getattr(module, "base_model_prefix", None) or None
    keys = list(checkpoint_keys)
    renamed = {rename_source_key(key, renamings, converters, prefix, expected)[0] for key in keys}
    if renamed == set(keys):
        return False
    missing = set(expected) - renamed - set(allowed_missing)
    return not missing


__all__ = ["renames_explain"]

"""diffusers' spellings of `from_pretrained` arguments, accepted beside ours.

- `dtype=` (diffusers' current name) beside `torch_dtype=`: either one; both only when they agree.
- `use_safetensors`: None or True (the default here: weights are only ever read from safetensors); False
  asks for pickle weights, which this library never unpickles, so it is refused with the reason.
- `revision`, `token`, `cache_dir`, `local_files_only`, `variant`: passed to the Hub download
  (`hub.HubOptions`; `variant` picks the weight files as before).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from ..errors import LoadError
from ..folder.sources import HubOptions


def chosen_dtype(torch_dtype: Any, dtype: Any) -> Any:
    """The dtype spec from `torch_dtype=` or diffusers' `dtype=` (both: they must agree)."""
    if dtype is None:
        return torch_dtype
    if torch_dtype is not None and torch_dtype != dtype:
        raise LoadError(
            f"from_pretrained got torch_dtype={torch_dtype!r} and dtype={dtype!r}; they are two spellings of one "
            "argument, pass one."
        )
    return dtype


# Why use_safetensors=False is refused, wherever it is given (loading_keywords' table says the same).
SAFETENSORS_ONLY = ("weights are only ever read from safetensors: pickle (.bin/.pt) can run code and this library "
                    "never unpickles it; convert the checkpoint to safetensors, or pass use_safetensors=True / "
                    "leave it out")


def pickle_opt_in(use_safetensors: bool | None, device_map: Any) -> bool:
    """Whether a pipeline load may let a component's owner library read its pickle weights: only when asked
    explicitly, `use_safetensors=False`, and only without `device_map` (the owner's `from_pretrained` then reads
    them with `torch.load(weights_only=True)`; this library itself never unpickles). A placed load streams
    safetensors only, so the opt-in is refused there with the reason."""
    if use_safetensors is not False:
        return False
    if device_map is not None:
        raise LoadError(
            f"from_pretrained(use_safetensors=False, device_map={device_map!r}): a placed load reads safetensors "
            "only, streaming each tensor to its device; pickle weights can be read by their owner library in a load "
            "without device_map (device_map=None), or converted once to safetensors "
            "(ModelClass.from_pretrained(folder).save_pretrained(folder))."
        )
    return True


def download_options(*, use_safetensors: bool | None, revision: str | None, token: str | bool | None,
                     cache_dir: str | os.PathLike | None, local_files_only: bool) -> HubOptions:
    if use_safetensors is False:
        raise LoadError(f"from_pretrained(use_safetensors=False) is not supported: {SAFETENSORS_ONLY}.")
    return HubOptions(revision=revision, token=token, cache_dir=cache_dir, local_files_only=bool(local_files_only))


HUB_KEYWORDS = ("revision", "token", "cache_dir", "local_files_only")


def with_hub_keywords(hub: HubOptions, keywords: Mapping[str, Any]) -> tuple[HubOptions, dict[str, Any]]:
    """diffusers' download keywords given by name to an entry that takes `hub=HubOptions(...)` (`load_model`),
    merged into it; the other keywords returned as they are."""
    given = {name: keywords[name] for name in HUB_KEYWORDS if name in keywords}
    rest = {name: value for name, value in keywords.items() if name not in given}
    if "local_files_only" in given:
        given["local_files_only"] = bool(given["local_files_only"])
    return (dataclasses.replace(hub, **given) if given else hub), rest

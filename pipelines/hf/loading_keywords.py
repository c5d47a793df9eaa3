"""Keywords of diffusers' (and transformers') `from_pretrained` that our entries do not take as their own, and
the one message for a keyword that is nothing at all.

Users coming from diffusers pass its loading keywords by habit. Each one known here is accepted when what it asks
for is what every load here does anyway (the value is then dropped, and `why` says what we do instead), and refused
by name with the reason otherwise. A keyword that is none of these, not an argument of the entry and not a
component of the pipeline is an `UnknownKeywordError` naming the closest known name:
"unknown keyword 'max_mem' (did you mean max_memory?)". A keyword that is a component name always means a
component passed in: components are checked by the loader, which knows them.

diffusers' spellings of `from_pretrained` arguments, accepted beside ours.

- `dtype=` (diffusers' current name) beside `torch_dtype=`: either one; both only when they agree.
- `use_safetensors`: None or True (the default here: weights are only ever read from safetensors); False
  asks for pickle weights, which this library never unpickles, so it is refused with the reason.
- `revision`, `token`, `cache_dir`, `local_files_only`, `variant`: passed to the Hub download
  (`hub.HubOptions`; `variant` picks the weight files as before)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import LoadError, UnknownKeywordError
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


logger = logging.getLogger(__name__)

ANY_VALUE = None  # `ForeignKeyword.accepted`: every value is fine


@dataclass(frozen=True, kw_only=True)
class ForeignKeyword:
    """A loading keyword of diffusers/transformers: `accepted` values (ANY_VALUE: all) are dropped, because each
    load here does that anyway; any other value is refused. `why` says what we do instead, or why we cannot."""

    name: str
    accepted: tuple | None
    why: str

    def takes(self, value: Any) -> bool:
        return self.accepted is ANY_VALUE or any(value is ok or value == ok for ok in self.accepted)


_ONNX = ("this library places PyTorch modules; ONNX Runtime pipelines are diffusers' Onnx*Pipeline classes, loaded "
         "by diffusers without placement")
_REMOTE = ("this library never downloads and runs pipeline code; build the pipeline with diffusers "
           "(DiffusionPipeline.from_pretrained(..., custom_pipeline=...)) and place it with "
           "pipelines.place(pipe, device_map=...)")
FOREIGN_KEYWORDS: dict[str, ForeignKeyword] = {keyword.name: keyword for keyword in (
    ForeignKeyword(name="low_cpu_mem_usage", accepted=(True, None),
                   why="every load here builds the model on meta and streams each tensor from its file to its device "
                       "(what low_cpu_mem_usage=True does); there is no random-init load to ask for"),
    ForeignKeyword(name="offload_state_dict", accepted=ANY_VALUE,
                   why="no state dict is held in RAM during a load here (each tensor goes from its file to its "
                       "device), so there is none to offload"),
    ForeignKeyword(name="disable_mmap", accepted=ANY_VALUE,
                   why="weights are read tensor by tensor with safetensors' safe_open, one tensor at a time"),
    ForeignKeyword(name="resume_download", accepted=ANY_VALUE,
                   why="huggingface_hub resumes interrupted downloads by itself"),
    ForeignKeyword(name="use_safetensors", accepted=(True, None), why=SAFETENSORS_ONLY),
    ForeignKeyword(name="use_onnx", accepted=(False, None), why=_ONNX),
    ForeignKeyword(name="provider", accepted=(None,), why=_ONNX),
    ForeignKeyword(name="provider_options", accepted=(None,), why=_ONNX),
    ForeignKeyword(name="sess_options", accepted=(None,), why=_ONNX),
    ForeignKeyword(name="from_flax", accepted=(False, None),
                   why="Flax weights are not read (safetensors only); convert them with diffusers first"),
    ForeignKeyword(name="custom_pipeline", accepted=(None,), why=_REMOTE),
    ForeignKeyword(name="custom_revision", accepted=(None,), why=_REMOTE),
    ForeignKeyword(name="dduf_file", accepted=(None,),
                   why="DDUF archives are not read; extract the archive into a folder and load that folder"),
    ForeignKeyword(name="load_connected_pipeline", accepted=(False, None),
                   why="connected pipelines are not loaded; load each pipeline's folder by itself"),
    ForeignKeyword(name="force_download", accepted=(False, None),
                   why="downloads go through huggingface_hub's cache; to fetch again, delete the cached snapshot "
                       "(hf cache delete)"),
    ForeignKeyword(name="proxies", accepted=(None,),
                   why="set HTTPS_PROXY in the environment: huggingface_hub uses it"),
    ForeignKeyword(name="mirror", accepted=(None,), why="set HF_ENDPOINT in the environment: huggingface_hub uses it"),
    ForeignKeyword(name="output_loading_info", accepted=(False, None),
                   why="a load here checks every key and raises on a missing or unexpected one, naming it, so "
                       "there is no loading info to return"),
    ForeignKeyword(name="ignore_mismatched_sizes", accepted=(False, None),
                   why="a tensor whose shape differs from the config is an error here (CheckpointShapeError, naming "
                       "both shapes); fix the config or the checkpoint"),
)}


def take_foreign_keywords(keywords: Mapping[str, Any], *, entry: str, own: Iterable[str] = ()) -> dict[str, Any]:
    """`keywords` without the diffusers loading keywords they hold: accepted ones dropped (logged with what we do
    instead), refused ones a `LoadError` naming the keyword and why. `own`: names that mean something
    else at this entry (components of the pipeline), left as they are."""
    rest, own = {}, set(own)
    for name, value in keywords.items():
        keyword = FOREIGN_KEYWORDS.get(name)
        if keyword is None or name in own:
            rest[name] = value
        elif keyword.takes(value):
            logger.info("%s(%s=%r): accepted and not needed: %s.", entry, name, value, keyword.why)
        else:
            raise LoadError(f"{entry}({name}={value!r}) is not supported: {keyword.why}.")
    return rest


def unknown_keyword_error(names: Iterable[str], *, entry: str, arguments: Iterable[str],
                          components: Iterable[str] | None = None, owner: str = "") -> UnknownKeywordError:
    """The error for keywords that are nothing at `entry`: each with the closest of `arguments` (the entry's own
    keywords) and `components` (None: the entry takes no components), as "did you mean ...?"."""
    names, arguments = sorted(names), sorted(set(arguments))
    candidates = arguments + sorted(components or ())
    described = []
    for name in names:
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
        described.append(f"{name!r} (did you mean {close[0]}?)" if close else repr(name))
    noun = "keyword" if len(names) == 1 else "keywords"
    if all("did you mean" in text for text in described):
        return UnknownKeywordError(f"{entry}: unknown {noun} {', '.join(described)}.")
    known = f"its arguments are {', '.join(arguments)}"
    if components is not None:
        known += f"; {owner or 'the pipeline'}'s components (passed in by name) are {sorted(components)}"
    return UnknownKeywordError(f"{entry}: unknown {noun} {', '.join(described)}: {known}.")


def unknown_pipeline_keywords(names: Iterable[str], *, pipeline: str, components: Iterable[str],
                              arguments: Iterable[str]) -> UnknownKeywordError:
    """Keywords given to a pipeline's from_pretrained/plan_placement that are neither its `arguments` (the fields
    of `loading.request.LoadOptions` a pipeline takes) nor components of `pipeline` (the class name)."""
    return unknown_keyword_error(names, entry=f"{pipeline}.from_pretrained/plan_placement", arguments=arguments,
                                 components=components, owner=pipeline)


def check_no_keywords_left(keywords: Mapping[str, Any], *, entry: Callable, label: str) -> None:
    """For an entry without components (a model's from_pretrained, `load_model`, `place`): the diffusers keywords
    taken (see `take_foreign_keywords`), nothing else left. `label`: the entry as the user called it."""
    rest = take_foreign_keywords(keywords, entry=label)
    if rest:
        arguments = [name for name, parameter in inspect.signature(entry).parameters.items()
                     if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
        raise unknown_keyword_error(rest, entry=label, arguments=arguments)


__all__ = ["FOREIGN_KEYWORDS", "ForeignKeyword", "check_no_keywords_left",
           "take_foreign_keywords", "unknown_keyword_error", "unknown_pipeline_keywords"]

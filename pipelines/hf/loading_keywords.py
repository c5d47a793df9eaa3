"""Keywords of diffusers' (and transformers') `from_pretrained` that our entries do not take as their own:
users pass them by habit, so each is accepted (dropped, logged with what every load here does instead) or refused
by name with the reason; anything else is an `UnknownKeywordError` naming the closest known name."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import LoadError, UnknownKeywordError
from ..folder.sources import HubOptions


def chosen_dtype(torch_dtype: Any, dtype: Any) -> Any:
    if dtype is None:
        return torch_dtype
    if torch_dtype is not None and torch_dtype != dtype:
        raise LoadError(
            f"from_pretrained got torch_dtype={torch_dtype!r} and dtype={dtype!r}; they are two spellings of one "
            "argument, pass one."
        )
    return dtype


SAFETENSORS_ONLY = ("weights are only ever read from safetensors: pickle (.bin/.pt) can run code and this library "
                    "never unpickles it; convert the checkpoint to safetensors, or pass use_safetensors=True / "
                    "leave it out")


def pickle_opt_in(use_safetensors: bool | None, device_map: Any) -> bool:
    """Whether a pipeline load lets a component's owner read its pickle weights (`torch.load(weights_only=True)`;
    this library never unpickles): only on `use_safetensors=False` without `device_map`."""
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


HUB_KEYWORDS = ("revision", "token", "cache_dir", "local_files_only")


def with_hub_keywords(hub: HubOptions, keywords: Mapping[str, Any]) -> tuple[HubOptions, dict[str, Any]]:
    """diffusers' download keywords given by name to an entry that takes `hub=` (`load_model`), merged into it."""
    given = {name: keywords[name] for name in HUB_KEYWORDS if name in keywords}
    rest = {name: value for name, value in keywords.items() if name not in given}
    if "local_files_only" in given:
        given["local_files_only"] = bool(given["local_files_only"])
    return (dataclasses.replace(hub, **given) if given else hub), rest


logger = logging.getLogger(__name__)

ANY_VALUE = None  # `ForeignKeyword.accepted`: every value is fine


@dataclass(frozen=True, kw_only=True)
class ForeignKeyword:
    """`accepted` values (ANY_VALUE: all) are dropped, any other is refused; `why` says what we do instead."""

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
    """`keywords` without the diffusers loading keywords they hold (accepted ones dropped, refused ones raised);
    `own`: names that mean something else at this entry (the pipeline's components)."""
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
    """The error for keywords that are nothing at `entry`, each with the closest of `arguments` and `components`
    (None: the entry takes no components)."""
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
    return unknown_keyword_error(names, entry=f"{pipeline}.from_pretrained/plan_placement", arguments=arguments,
                                 components=components, owner=pipeline)


def check_no_keywords_left(keywords: Mapping[str, Any], *, entry: Callable, label: str) -> None:
    """For an entry without components: the diffusers keywords taken, nothing else left."""
    rest = take_foreign_keywords(keywords, entry=label)
    if rest:
        arguments = [name for name, parameter in inspect.signature(entry).parameters.items()
                     if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
        raise unknown_keyword_error(rest, entry=label, arguments=arguments)


__all__ = ["FOREIGN_KEYWORDS", "ForeignKeyword", "check_no_keywords_left",
           "take_foreign_keywords", "unknown_keyword_error", "unknown_pipeline_keywords"]

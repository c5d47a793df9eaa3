"""What the CLI prints, in its own words: budgets parsed by `placement`, library messages in flag names,
warnings once. Imported when a command runs (it imports `placement`, hence torch), never for `--help`."""

from __future__ import annotations

import re
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

from placement.devices import device_label, normalize_device
from placement.errors import PlacementError
from placement.budgets import exact_budgets, warn_zero_budgets
from placement.sizes import parse_budget

from ..errors import LoadError

from .args import BUDGET_EXAMPLE, BudgetsArg


def resolve_budgets_arg(budgets: BudgetsArg | None, flag: str) -> dict | None:
    """{0: "…B", 1: "…B", "cpu": "…B"} (exact bytes, `placement.budgets.exact_budgets`) from a parsed flag; a bad
    size or a device named twice is an error that names the flag."""
    if budgets is None:
        return None
    resolved: dict = {}
    spelled: dict = {}
    for device_text, size_text in budgets.items:
        try:
            device, size = normalize_device(device_text), parse_budget(size_text)
        except PlacementError as error:
            example = "" if "did you mean" in str(error) else f" Write e.g. {flag} {BUDGET_EXAMPLE}."
            raise LoadError(f"{flag} {budgets.text}: {error}{example}") from error
        if device in resolved:
            raise LoadError(
                f"{flag} {budgets.text} names {device_label(device)} twice ({spelled[device]!r} and {device_text!r}); "
                "keep one."
            )
        resolved[device], spelled[device] = size, device_text
    warn_zero_budgets([device for device, size in resolved.items() if size == 0])
    return exact_budgets(resolved)


# Library messages speak Python (they serve API users); on the command line the same advice names flags.
_FLAG_SPELLINGS = [
    (re.compile(r"max_memory=\{0: '24GiB', \.\.\.\}"), "--max-memory 0=24GiB,..."),
    (re.compile(r"torch_dtype=torch\.bfloat16"), "--dtype bf16"),
    (re.compile(r"max_memory\['disk'\]"), "the disk= budget in --max-memory"),
    (re.compile(r"offload_folder=\.\.\."), "--offload-folder DIR"),
    (re.compile(r"device_map='(\w+)'"), r"--strategy \1"),
    (re.compile(r"\bmax_memory\b"), "--max-memory"),
    (re.compile(r"\boffload_folder\b"), "--offload-folder"),
    (re.compile(r"\bactivations= \(or call=\)"), "--height and --width"),
    (re.compile(r"\bstrength=([\d.]+):"), r"--strength \1:"),
    (re.compile(r"\bleave strength out\b"), "leave --strength out"),
    (re.compile(r"\(gpu=\)"), "(--gpu)"),
]


def in_flag_names(text: str) -> str:
    for pattern, replacement in _FLAG_SPELLINGS:
        text = pattern.sub(replacement, text)
    return text


@contextmanager
def warnings_once(already_shown: list[str] | None = None) -> Iterator[list[str]]:
    """Collect the library's warnings while the body runs, then print each distinct one once to stderr,
    in flag names, skipping those the caller prints anyway (e.g. in the plan's own warnings)."""
    caught_messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught_messages
    shown = set(already_shown or []) | set(caught_messages)
    for warning in caught:
        message = str(warning.message)
        if message not in shown:
            shown.add(message)
            print(f"warning: {in_flag_names(message)}", file=sys.stderr)

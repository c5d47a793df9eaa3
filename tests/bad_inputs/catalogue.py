"""The bad-input catalogue: one table of cases, each graded the same way.

A case does one careless or unlucky thing in a fresh temporary folder and says what must happen: the exception
type (a dotted path; None when the right outcome is to succeed without harm) and words its message must contain
(case-insensitive). `harm(tmp)` optionally checks afterwards for damage (a file lost, code run, a folder left
behind). Grades, worst first:

    unsafe     harm was done (or, for `harm_if_accepted`, the bad input was used without a word)
    traceback  a raw library error (not a `PlacementError`), or the CLI exited 1 / printed a traceback
    silent     accepted without an error
    vague      a `PlacementError`, but not the expected type or missing some of the words
    clear      the expected outcome

To extend it, add a `Case(...)` to a table in `cases_files.py`, `cases_calls.py`, `cases_cli.py` or
`cases_first_hour.py`; `test_bad_inputs.py` runs them
all, and `python tests/bad_inputs/grade.py` prints the counts per grade (works on any checkout of the library).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable


class Grade(str, Enum):
    CLEAR = "clear"
    VAGUE = "vague"
    SILENT = "silent"
    UNSAFE = "unsafe"
    TRACEBACK = "traceback"


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    run: Callable[[Path], object]
    error: str | None  # dotted path of the expected exception class; None: must succeed, doing no harm
    words: tuple[str, ...] = ()
    harm: Callable[[Path], bool] | None = None
    harm_if_accepted: bool = False  # accepting this input at all means something outside was read or run
    known_gap: str = ""  # why this case is not clear yet and who owns the fix (the test expects it to fail)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    grade: Grade
    detail: str = field(default="")


class CliFailure(Exception):
    """Raised by CLI cases for a nonzero exit: `code` and the printed `stderr`."""

    def __init__(self, code: int, stderr: str):
        super().__init__(stderr.strip())
        self.code, self.stderr = code, stderr


def grade(case: Case, tmp: Path) -> Outcome:
    try:
        case.run(tmp)
    except Exception as error:  # noqa: BLE001 - grading every kind of failure is the point
        outcome = _grade_error(case, error)
    else:
        outcome = _grade_success(case)
    if case.harm is not None and case.harm(tmp):
        return Outcome(grade=Grade.UNSAFE, detail=f"harm observed ({outcome.grade.value}: {outcome.detail})")
    return outcome


def _grade_success(case: Case) -> Outcome:
    if case.error is None:
        return Outcome(grade=Grade.CLEAR)
    if case.harm_if_accepted:
        return Outcome(grade=Grade.UNSAFE, detail="accepted an input that reaches outside")
    return Outcome(grade=Grade.SILENT, detail=f"no error (expected {case.error})")


def _grade_error(case: Case, error: Exception) -> Outcome:
    placement_error = _resolve("placement.errors.PlacementError")
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, CliFailure):
        if error.code != 2 or "Traceback" in error.stderr:
            return Outcome(grade=Grade.TRACEBACK, detail=message)
    elif not isinstance(error, placement_error):
        return Outcome(grade=Grade.TRACEBACK, detail=message)
    expected = _resolve(case.error) if case.error else None
    if expected is None or not isinstance(error, expected):
        if case.error is None or not isinstance(error, CliFailure):  # a command that should have succeeded too
            return Outcome(grade=Grade.VAGUE, detail=f"{message} (expected {case.error})")
    missing = [word for word in case.words if word.lower() not in str(error).lower()]
    if missing:
        return Outcome(grade=Grade.VAGUE, detail=f"{message} (missing {missing})")
    return Outcome(grade=Grade.CLEAR, detail=message)


def _resolve(dotted: str | None) -> type | None:
    """The class at `dotted` (None where this version of the library lacks it)."""
    if dotted is None:
        return None
    module_name, _, class_name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:
        return None

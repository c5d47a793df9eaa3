"""Every case of the bad-input catalogue gets its clear, typed outcome (see catalogue.py to add one)."""

from __future__ import annotations

import warnings

import pytest
from catalogue import Grade, grade
from cases_calls import CASES as CALL_CASES
from cases_cli import CASES as CLI_CASES
from cases_files import CASES as FILE_CASES
from cases_first_hour import CASES as FIRST_HOUR_CASES
from cases_nothing_lost import CASES as NOTHING_LOST_CASES

ALL_CASES = FILE_CASES + CALL_CASES + CLI_CASES + FIRST_HOUR_CASES + NOTHING_LOST_CASES


def test_case_names_are_unique():
    names = [case.name for case in ALL_CASES]
    assert len(names) == len(set(names)) and len(names) >= 50


@pytest.mark.parametrize("case", ALL_CASES, ids=[case.name for case in ALL_CASES])
def test_bad_input_gets_a_clear_outcome(case, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcome = grade(case, tmp_path)
    if case.known_gap and outcome.grade is not Grade.CLEAR:
        pytest.xfail(f"known gap: {case.known_gap} ({outcome.grade.value}: {outcome.detail})")
    assert outcome.grade is Grade.CLEAR, outcome.detail

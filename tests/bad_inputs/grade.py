"""Run the whole bad-input catalogue and print one line per case and the count per grade.

    PYTHONPATH=<checkout> python tests/bad_inputs/grade.py [--verbose]

It only uses the library's public entry points, so it grades any checkout (e.g. an older commit).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from catalogue import Grade, grade  # noqa: E402
from cases_calls import CASES as CALL_CASES  # noqa: E402
from cases_cli import CASES as CLI_CASES  # noqa: E402
from cases_files import CASES as FILE_CASES  # noqa: E402
from cases_first_hour import CASES as FIRST_HOUR_CASES  # noqa: E402
from cases_nothing_lost import CASES as NOTHING_LOST_CASES  # noqa: E402

ALL_CASES = FILE_CASES + CALL_CASES + CLI_CASES + FIRST_HOUR_CASES + NOTHING_LOST_CASES


def main(verbose: bool) -> Counter:
    counts: Counter = Counter()
    for case in ALL_CASES:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = grade(case, Path(tmp))
        counts[outcome.grade] += 1
        print(f"{outcome.grade.value:9} {case.name}" + (f"  -- {outcome.detail[:160]}" if verbose else ""))
    print(f"{len(ALL_CASES)} cases: " + ", ".join(f"{g.value} {counts[g]}" for g in Grade))
    return counts


if __name__ == "__main__":
    main("--verbose" in sys.argv)

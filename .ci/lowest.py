"""Print pip constraints that pin every requirement of pyproject.toml to the lowest version its range allows.

pip has no "lowest" resolver: CI's second stage installs `pip install -c <this output> -e ".[dev,hf,quant]"`, so
each floor written in pyproject.toml (`name>=floor`) is installed and tested as it is, and a floor that no longer
installs or passes fails CI instead of a user's fresh install. Every requirement of `dependencies` and of every
extra must carry a `>=` floor: one without it could not be pinned, and is an error here.

Usage: python .ci/lowest.py [pyproject.toml] > lowest-constraints.txt   (standard library only: it runs before
anything is installed.)
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# The one exception to "the floor": torch 2.13.0 is the only torch build on CI's disk (a bare torch requirement
# pulls a multi-GB CUDA build), so both stages run it; its range keeps older torches installable for users.
KEPT = {"torch": "2.13.0"}

REQUIREMENT = re.compile(r"\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(?P<specifiers>[^;]*)")


class FloorMissing(ValueError):
    """A requirement of pyproject.toml has no `>=` floor, so the lowest-versions run could not pin it."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: str) -> list[str]:
    """Every requirement string of `dependencies` and of all optional-dependencies extras."""
    project = tomllib.loads(pyproject)["project"]
    extras = project.get("optional-dependencies", {})
    return [*project.get("dependencies", []), *(r for extra in extras.values() for r in extra)]


def floor(requirement: str) -> tuple[str, str]:
    """(normalized name, the version after `>=`) of one requirement string."""
    match = REQUIREMENT.match(requirement)
    specifiers = [part.strip() for part in match.group("specifiers").split(",") if part.strip()]
    floors = [spec[2:].strip() for spec in specifiers if spec.startswith(">=")]
    if len(floors) != 1:
        raise FloorMissing(f"pyproject.toml requirement {requirement!r} has {len(floors)} '>=' floors; give it "
                           f"exactly one (the lowest version that installs and passes), so CI's lowest-versions "
                           f"stage can pin it")
    return normalized(match.group("name")), floors[0]


def constraints(pyproject: str) -> dict[str, str]:
    """{normalized name: the version CI's lowest stage installs}: each floor, torch kept at its one build."""
    pinned: dict[str, str] = {}
    for requirement in requirements(pyproject):
        name, version = floor(requirement)
        pinned[name] = KEPT.get(name, version)
    return pinned


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "pyproject.toml"
    for name, version in constraints(path.read_text()).items():
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Memory sizes: the one place where size strings are parsed and bytes are formatted.

KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024, case-insensitive; a bare int is bytes. Unlike accelerate,
"10gb" means gigabytes, never gigabits. A budget (`parse_budget`) without a unit under 1 MiB is refused: it is
almost always a unit left out (24 GiB meant, 24 bytes would plan everything onto the CPU).
"""

from __future__ import annotations

import re

from .errors import PlanError

_UNITS = {"b": 1, **{f"{prefix}b": 1000 ** (i + 1) for i, prefix in enumerate("kmgt")},
          **{f"{prefix}ib": 1024 ** (i + 1) for i, prefix in enumerate("kmgt")}}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

GiB = 1024**3
MiB = 1024**2
MIN_BARE_BUDGET = MiB  # a bare-number budget below this (and above 0) is taken for a unit left out


def parse_size(value: int | float | str) -> int:
    """Bytes for `value`: an int of bytes or a string such as "24GiB", "10GB", "512 MiB", "1024"."""
    if isinstance(value, bool):
        raise PlanError(f"Invalid memory size {value!r}: expected bytes (int) or a string like '24GiB'.")
    if isinstance(value, int):
        return _non_negative(value, value)
    if isinstance(value, float) and value.is_integer():
        return _non_negative(int(value), value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match and (unit == "" or unit in _UNITS):
            return _non_negative(int(float(match.group(1)) * _UNITS.get(unit, 1)), value)
    raise PlanError(
        f"Invalid memory size {value!r}: expected bytes (int) or a number followed by one of "
        "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '24GiB'."
    )


def parse_budget(value: int | float | str) -> int:
    """Bytes for a budget: `parse_size`, except that a number with no unit (an int, or a string of digits) from 1
    to just under 1 MiB is an error that suggests the unit it probably lacks (24 -> "24GiB"). 0 is accepted (no
    room on that device); "5000B" is 5000 bytes (see the module docstring)."""
    size = parse_size(value)
    if 0 < size < MIN_BARE_BUDGET and _is_bare_number(value):
        guess = f"{size}GiB" if size < 4096 else f"{size}MiB"
        raise PlanError(
            f"{value!r} means {size} byte{'s' if size > 1 else ''} (a number without a unit counts bytes): did you "
            f"mean {guess!r}? "
            f"Write the unit: {guess!r}, or {f'{size}B'!r} if you do mean bytes."
        )
    return size


def _is_bare_number(value) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    match = _SIZE.match(value) if isinstance(value, str) else None
    return bool(match) and match.group(2) == ""


def _non_negative(n: int, original) -> int:
    if n < 0:
        raise PlanError(f"Invalid memory size {original!r}: a size cannot be negative.")
    return n


def format_bytes(n: int | float) -> str:
    """Bytes in the largest binary unit that keeps the number readable: "24.00 GiB", "312.50 KiB", "17 B"."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


def format_size(n: int | float, unit: str = "GiB", digits: int = 2) -> str:
    """`format_size(1.5 * GiB)` -> "1.50 GiB"."""
    return f"{n / _UNITS[unit.lower()]:.{digits}f} {unit}"

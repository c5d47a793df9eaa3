import pytest
import torch

from placement import InvalidDeviceError, PlanError, normalize_device, parse_size
from placement.sizes import format_size, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("10GB", 10 * 1000**3),
        ("10gb", 10 * 1000**3),  # accelerate reads this as gigabits; we read bytes
        ("24GiB", 24 * 1024**3),
        ("24gib", 24 * 1024**3),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("512MiB", 512 * 1024**2),
        ("7B", 7),
        ("2TB", 2 * 1000**4),
        (3.0, 3),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["ten GB", "10 gigs", "GiB", "", "-1GB", -5, True, 1.5, None, "10 Gb s"])
def test_parse_size_rejects_and_quotes_the_input(bad):
    with pytest.raises(PlanError, match=repr(bad).replace("(", r"\(").replace(")", r"\)")[:8]):
        parse_size(bad)


def test_format_size():
    assert format_size(3 * 1024**3 // 2) == "1.50 GiB"
    assert format_size(512 * 1024**2, "MiB", 0) == "512 MiB"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(0, 0), (3, 3), ("1", 1), ("cuda", 0), ("cuda:1", 1), (torch.device("cuda", 2), 2), ("cpu", "cpu"),
     (torch.device("cpu"), "cpu"), ("disk", "disk"), ("CPU", "cpu")],
)
def test_normalize_device(spec, expected):
    assert normalize_device(spec) == expected


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", -1, True, 1.0, "tpu:0"])
def test_normalize_device_rejects(bad):
    with pytest.raises(InvalidDeviceError, match="Invalid device"):
        normalize_device(bad)


@pytest.mark.parametrize(("typed", "guess"), [("24", "'24GiB'"), ("80", "'80GiB'"), ("8000", "'8000MiB'"), ("1", "'1GiB'")])
def test_a_budget_typed_without_its_unit_is_refused_with_the_unit_it_lacks(typed, guess):
    with pytest.raises(PlanError, match=f"'{typed}' means {typed} bytes? .*did you mean {guess}"):
        parse_budget(typed)


@pytest.mark.parametrize(("typed", "guess"), [(24, "'24GiB'"), (600, "'600GiB'"), (8000, "'8000MiB'"),
                                              (1024**2 - 1, "'1048575MiB'")])
def test_an_int_budget_under_one_mib_is_a_unit_left_out_too(typed, guess):
    with pytest.raises(PlanError, match=rf"^{typed} means {typed} bytes .*did you mean {guess}.*'{typed}B' if"):
        parse_budget(typed)


@pytest.mark.parametrize(("value", "expected"), [("0", 0), (0, 0), ("24B", 24), ("5000B", 5000), ("4KiB", 4096),
                                                 (1024**2, 1024**2), ("1048576", 1024**2), ("24GiB", 24 * 1024**3)])
def test_budgets_with_a_unit_zero_and_from_one_mib_are_taken_as_they_are(value, expected):
    assert parse_budget(value) == expected  # "24B" says it means bytes

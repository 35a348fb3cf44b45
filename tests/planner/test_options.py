"""The planner's argument types."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtest.planner import options


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "NaN", "1e999"])
def test_no_float_type_takes_a_number_that_is_not_finite(text: str) -> None:
    for parse in (options.finite, options.positive, options.non_negative, options.share):
        with pytest.raises(argparse.ArgumentTypeError, match="finite"):
            parse(text)


def test_integer_types_name_their_minimum() -> None:
    assert options.seed("0") == 0 and options.count("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 0, not -1"):
        options.seed("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="not an integer"):
        options.count("1.5")


def test_unwritable_says_why(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert options.unwritable(tmp_path / "new" / "deeper" / "plan.yaml") is None
    assert options.unwritable(afile) is None
    assert "is a folder" in (options.unwritable(tmp_path) or "")
    assert "is not a folder" in (options.unwritable(afile / "plan.yaml") or "")

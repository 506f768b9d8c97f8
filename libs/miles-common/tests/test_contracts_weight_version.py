"""One reading of SGLang's weight_version label: "default" is the initial version 0, no version is None."""

from __future__ import annotations

import pytest

from miles.common.contracts.weight_version import (
    DEFAULT_LABEL,
    INITIAL_WEIGHT_VERSION,
    UNKNOWN_WEIGHT_VERSION,
    parse_weight_version,
)


@pytest.mark.parametrize(("label", "version"), [("0", 0), ("7", 7), (" 12 ", 12), ("007", 7), (3, 3), (0, 0)])
def test_integer_labels_are_their_version(label: object, version: int) -> None:
    assert parse_weight_version(label) == version


def test_default_is_the_initial_weights_version_0() -> None:
    assert parse_weight_version(DEFAULT_LABEL) == INITIAL_WEIGHT_VERSION == 0
    assert parse_weight_version(" default ") == 0


@pytest.mark.parametrize(
    "label",
    [None, "", "   ", "Default", "v2", "1.5", "-1", "-3", "+4", "1_000", "²", "0x10", -1, True, False, 2.0, b"3"],
)
def test_anything_that_is_no_version_is_unknown(label: object) -> None:
    """Absent, negative (miles versions start at 0), other spellings and other types: the caller decides."""
    assert parse_weight_version(label) is None


def test_unknown_is_below_every_version() -> None:
    assert UNKNOWN_WEIGHT_VERSION < INITIAL_WEIGHT_VERSION

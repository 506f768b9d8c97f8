"""What weight-sync makes of an engine's reported weight_version, and which engines the reconciler catches up.

"default" is the initial weights, version 0 (miles.common.contracts.weight_version): a fresh engine already holds
version 0 and is not reloaded with it; a label that is no version is unknown (-1), behind every stored version.
"""

from __future__ import annotations

import pytest

from miles.weightsync.engines import EngineOutcome, reported_version
from miles.weightsync.reconcile import Reconciler


@pytest.mark.parametrize(("label", "version"), [("default", 0), ("0", 0), ("7", 7), (None, -1), ("", -1), ("v2", -1)])
def test_reported_labels_become_versions(label: str | None, version: int) -> None:
    assert reported_version(label) == version


def test_a_fresh_engine_is_caught_up_only_when_a_version_after_the_initial_one_is_stored() -> None:
    reconciler = Reconciler(initial_backoff_s=1.0, max_backoff_s=8.0)
    fresh = EngineOutcome("http://fresh", reported_version("default"))
    unknown = EngineOutcome("http://unknown", reported_version(None))
    assert reconciler.behind(0, [fresh, unknown], now_s=0.0) == ["http://unknown"]
    assert reconciler.behind(1, [fresh, unknown], now_s=0.0) == ["http://fresh", "http://unknown"]

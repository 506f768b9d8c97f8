"""SGLang's `weight_version` label read as a miles weight version: one parse, one meaning of "default".

SGLang reports the version of the weights it serves as a string (`meta_info.weight_version`, `/model_info`,
`/get_weight_version`); miles versions are integers >= 0, and every miles component that sets the label writes
`str(version)`. Before its first update an engine reports what it was started with, SGLang's `"default"`.

**"default" is version 0** (`INITIAL_WEIGHT_VERSION`): the weights the engine loaded at start, which in miles are
the job's initial weights. The trainer publishes them as version 0 (`initial_weight_version`, default 0;
common.proto: "0 = initial weights") and an engine restarted mid-job also comes back on them. Reading "default"
as 0 is never too optimistic: 0 is the lowest version there is, so a fresh engine satisfies only
`min_weight_version <= 0`, and an engine that holds the latest version N > 0 is never taken for it. (Before this
module the router read "default" as unknown, weight-sync as -1, the engine and the session server as 0. Under 0
the router now follows an engine restarted on the initial weights back to 0 instead of keeping its last version,
and weight-sync no longer reloads version 0 into an engine that already serves it.)

Anything else that is not a non-negative integer — absent (None, ""), negative, or garbage ("v2", "1.5") — is
**unknown**: `parse_weight_version` returns None and each caller decides explicitly what unknown means for it
(the router: satisfies no minimum; weight-sync: `UNKNOWN_WEIGHT_VERSION`, behind every stored version; the
session server and the engine: the initial version, the most conservative number they can record).
"""

from __future__ import annotations

import re

DEFAULT_LABEL = "default"
"""SGLang's weight_version before the first update (its --weight-version default)."""

INITIAL_WEIGHT_VERSION = 0
"""The job's initial weights: what an engine started from the model path serves, and what "default" means."""

UNKNOWN_WEIGHT_VERSION = -1
"""The integer that int64 wire fields (router EngineInfo, weight-sync EngineVersion) use for "unknown"."""

_DIGITS = re.compile(r"[0-9]+")


def parse_weight_version(label: object) -> int | None:
    """The miles version of a reported weight_version: an int >= 0, `INITIAL_WEIGHT_VERSION` for "default", None
    when unknown (absent, negative, not an integer). Accepts the str SGLang sends and an int (a JSON number);
    surrounding whitespace is ignored, a bool is not a version."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label if label >= 0 else None
    if not isinstance(label, str):
        return None
    text = label.strip()
    if text == DEFAULT_LABEL:
        return INITIAL_WEIGHT_VERSION
    return int(text) if _DIGITS.fullmatch(text) else None

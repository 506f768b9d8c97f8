"""The weights digest: one content address of a set of named tensors, the same in every service.

`weights_digest` is the sha256 over the lines `"<name> <sha256 of the tensor's raw bytes>\\n"` sorted by name, so
it does not depend on the order in which tensors are listed (a trainer's parameter order, a manifest's header
order, an engine's module order). Every party computes it over the tensors in the same dtype (the version's
publish dtype, e.g. bfloat16): the trainer when it publishes a version, weight-sync in each manifest, engines in
`/weights_checker {"action": "checksum"}`. Two digests are equal exactly when the names and every byte are.

No torch here: callers hash their tensors' bytes themselves (`tensor_sha256` takes any buffer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from miles.common.errors import InvalidArgumentError


def tensor_sha256(raw: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of one tensor's raw little-endian bytes."""
    return hashlib.sha256(raw).hexdigest()


def weights_digest(tensor_sha256s: Mapping[str, str]) -> str:
    """Hex sha256 over `"<name> <sha256>\\n"` for every tensor, sorted by name."""
    hasher = hashlib.sha256()
    for name in sorted(tensor_sha256s):
        if not name or any(c in name for c in " \n"):
            raise InvalidArgumentError(f"tensor name {name!r} is empty or has a space or newline", field="name")
        hasher.update(f"{name} {tensor_sha256s[name]}\n".encode())
    return hasher.hexdigest()

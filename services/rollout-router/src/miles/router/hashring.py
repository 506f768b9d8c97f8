"""Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018), over engine URLs.

The ring holds `vnodes_per_engine` points per engine (blake2b-64 of "url#i", as the SGLang router does with
blake3). A key starts at its own hash and walks clockwise to the first candidate engine whose load is below
`ceil(load_factor * (total_load + 1) / num_candidates)`; so no engine takes more than `load_factor` times its
fair share, and when an engine joins or leaves only the keys that hashed to it (plus overflow) move. Every router
replica computes the same answer from the same engine set and loads.

Limits: rebuilt in O(engines * vnodes * log) on membership change (pools hold tens of engines, not thousands).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Collection


def load_bound(total_load: int, num_engines: int, load_factor: float) -> int:
    """Bounded load: the most requests one of `num_engines` engines may hold, ceil(factor * (total + 1) / n).

    Always above the least-loaded engine's load (which is at most total / n), so some engine is always under it.
    """
    return math.ceil(load_factor * (total_load + 1) / num_engines)


def hash64(data: str) -> int:
    """A stable 64-bit hash (the same on every process and platform, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "little")


class HashRing:
    """The ring of one pool; `add`/`remove` as engines join and leave."""

    def __init__(self, vnodes_per_engine: int = 150) -> None:
        if vnodes_per_engine < 1:
            raise ValueError("vnodes_per_engine must be >= 1")
        self.vnodes_per_engine = vnodes_per_engine
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()

    def __contains__(self, url: object) -> bool:
        return url in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, url: str) -> None:
        if url not in self._members:
            self._members.add(url)
            self._rebuild()

    def remove(self, url: str) -> None:
        if url in self._members:
            self._members.discard(url)
            self._rebuild()

    def walk(self, key: str) -> list[str]:
        """Every member once, in clockwise order starting at the key's position."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, hash64(key)) % len(self._points)
        order: list[str] = []
        seen: set[str] = set()
        for offset in range(len(self._points)):
            owner = self._owners[(start + offset) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
                if len(order) == len(self._members):
                    break
        return order

    def lookup(
        self,
        key: str,
        candidates: Collection[str],
        load_of: Callable[[str], int],
        load_factor: float,
    ) -> str | None:
        """The engine for `key` among `candidates` under the load bound; None when no candidate is on the ring.

        When every candidate is at the bound (possible only with load_factor near 1), the first one on the walk
        is returned: the bound spreads load, it never refuses a key.
        """
        walk = [url for url in self.walk(key) if url in candidates]
        if not walk:
            return None
        capacity = load_bound(sum(load_of(url) for url in walk), len(walk), load_factor)
        for url in walk:
            if load_of(url) < capacity:
                return url
        return walk[0]

    def _rebuild(self) -> None:
        points = sorted(
            (hash64(f"{url}#{index}"), url) for url in self._members for index in range(self.vnodes_per_engine)
        )
        self._points = [point for point, _ in points]
        self._owners = [url for _, url in points]

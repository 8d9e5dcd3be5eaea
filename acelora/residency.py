"""Which adapters to keep resident on a server with room for ``capacity``, and which to pre-warm.

Policies: ``lru`` (evict the least recently used), ``lfu`` (the least frequently used, ties by
recency) and ``forecast`` (the lowest forecast request rate: an exponentially decayed count of each
adapter's requests, so a burst fades with ``half_life_s``). ``prewarm_candidates`` ranks adapters that
are not resident by the same forecast: what to load next, before a request waits for it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

POLICIES = ("lru", "lfu", "forecast")


@dataclass(slots=True)
class AccessResult:
    """``hit``: the adapter was resident; ``evicted``: what had to go to make room for it."""

    hit: bool
    evicted: list[str] = field(default_factory=list)


class Residency:
    """A resident set of at most ``capacity`` adapters under an eviction policy.

    >>> r = Residency(capacity=2, policy="lru")
    >>> [r.access(n, t).hit for t, n in enumerate(["a", "b", "a", "c", "b"])]
    [False, False, True, False, False]
    """

    def __init__(self, capacity: int, policy: str = "lru", half_life_s: float = 60.0) -> None:
        if capacity < 1:
            raise ValueError("Residency capacity must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.capacity = capacity
        self.policy = policy
        self._decay = math.log(2) / half_life_s
        self._resident: OrderedDict[str, None] = OrderedDict()  # recency order, oldest first
        self._count: dict[str, int] = {}
        self._rate: dict[str, tuple[float, float]] = {}  # name -> (decayed count, at time)
        self.hits = 0
        self.misses = 0

    def __contains__(self, name: object) -> bool:
        return name in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    @property
    def resident(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._resident)

    def forecast(self, name: str, now: float) -> float:
        """Expected relative request rate of ``name`` at ``now`` (decayed request count)."""
        value, at = self._rate.get(name, (0.0, now))
        return value * math.exp(-self._decay * max(0.0, now - at))

    def access(self, name: str, now: float) -> AccessResult:
        """Record a request for ``name`` at time ``now`` (seconds); make it resident, evicting as needed."""
        self._count[name] = self._count.get(name, 0) + 1
        self._rate[name] = (self.forecast(name, now) + 1.0, now)
        if name in self._resident:
            self._resident.move_to_end(name)
            self.hits += 1
            return AccessResult(True)
        self.misses += 1
        evicted = []
        while len(self._resident) >= self.capacity:
            victim = self._victim(now)
            del self._resident[victim]
            evicted.append(victim)
        self._resident[name] = None
        return AccessResult(False, evicted)

    def remove(self, name: str) -> bool:
        """Forget that ``name`` is resident (it was unloaded elsewhere); True if it was."""
        return self._resident.pop(name, 0) is None

    def _victim(self, now: float) -> str:
        if self.policy == "lru":
            return next(iter(self._resident))
        order = {n: i for i, n in enumerate(self._resident)}  # recency breaks ties
        if self.policy == "lfu":
            return min(self._resident, key=lambda n: (self._count[n], order[n]))
        return min(self._resident, key=lambda n: (self.forecast(n, now), order[n]))

    def prewarm_candidates(self, now: float, k: int) -> list[str]:
        """Up to ``k`` adapters that are not resident, highest forecast first (never ones with no requests)."""
        ranked = sorted((n for n in self._rate if n not in self._resident),
                        key=lambda n: self.forecast(n, now), reverse=True)
        return [n for n in ranked if self.forecast(n, now) > 1e-6][:k]

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

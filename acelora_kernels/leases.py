"""Which adapters the running batch holds, and getting the next ones into the pool without stalling it.

The engine thread asks :meth:`AdapterLeases.take` before admitting a sequence. A resident adapter is
acquired at once (the pool will not evict it while any sequence uses it); a cold one is loaded by
``pool.prefetch`` in the background while the batch keeps decoding; one that does not fit (every
resident adapter is in use, or ``max_loras`` distinct adapters already run) waits until a release.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from acelora_kernels.errors import AdapterInUse, AdapterNotResident, AdapterTooLarge, PoolFull
from acelora_kernels.pool import AdapterPool, LoadResult


class AdapterLeases:
    """Reference-counted holds on pool adapters for the running batch (engine thread only).

    >>> leases = AdapterLeases(pool, max_loras=4, wake=lambda: None)  # doctest: +SKIP
    >>> leases.take("med-qa-v1", "/adapters/med-qa-v1")  # doctest: +SKIP
    None
    """

    def __init__(self, pool: AdapterPool, max_loras: int | None, wake: Callable[[], None]) -> None:
        self.pool = pool
        self.max_loras = max_loras
        self._wake = wake
        self._held: dict[str, tuple[Any, int]] = {}  # name -> (pool entry, sequences using it)
        self._loads: dict[str, Future[LoadResult]] = {}
        self._blocked: dict[str, int] = {}  # name -> release epoch at which it did not fit
        self._epoch = 0
        self.cold_loads = 0

    def held(self) -> list[str]:
        """Adapters the running batch holds."""
        return list(self._held)

    def take(self, name: str, path: str | os.PathLike[str]) -> bool | None:
        """Hold ``name`` for one more sequence: ``True`` held after a cold load, ``False`` held warm,
        ``None`` not yet (loading, or no room); raises when the adapter cannot be loaded at all."""
        if name in self._held:
            entry, n = self._held[name]
            self._held[name] = (entry, n + 1)
            return False
        if self.max_loras is not None and len(self._held) >= self.max_loras:
            return None
        cold = False
        fut = self._loads.get(name)
        if fut is not None:
            if not fut.done():
                return None
            del self._loads[name]
            err = fut.exception()
            if isinstance(err, PoolFull | AdapterInUse) and not isinstance(err, AdapterTooLarge):
                self._blocked[name] = self._epoch
                return None
            if err is not None:
                raise err
            cold = fut.result().cold
        elif self._blocked.get(name) == self._epoch:
            return None
        try:
            if name not in self.pool:
                raise AdapterNotResident(name)
            cold |= self.pool.load(name, path).cold  # warm: an LRU touch; a changed path reloads
            (entry,) = self.pool.acquire([name])
        except (AdapterNotResident, PoolFull, AdapterInUse):
            self._blocked.pop(name, None)
            fut = self.pool.prefetch(name, path)
            fut.add_done_callback(lambda _: self._wake())
            self._loads[name] = fut
            self.cold_loads += 1
            return None
        self._held[name] = (entry, 1)
        return cold

    def give(self, name: str) -> None:
        """One sequence using ``name`` is done; the last one releases it to the pool's LRU."""
        entry, n = self._held[name]
        if n > 1:
            self._held[name] = (entry, n - 1)
            return
        del self._held[name]
        self.pool.release([entry])
        self._epoch += 1  # room may have freed up for adapters that did not fit

    def may_progress(self, name: str) -> bool:
        """Could :meth:`take` succeed (or make progress) for ``name`` now?"""
        if name in self._held:
            return True
        fut = self._loads.get(name)
        if fut is not None:
            return fut.done()
        return self._blocked.get(name) != self._epoch

    def unblock(self) -> None:
        """Forget which adapters did not fit (pins held outside the engine may have been dropped)."""
        self._blocked.clear()

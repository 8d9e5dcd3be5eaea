"""``AdapterPool``: every resident adapter's weights in one preallocated buffer of fixed-size pages.

The buffer is ``[num_pages, page_elems]`` for one (device, dtype); the budget is bytes, not slots.
Each adapter is one flat virtual array (its safetensors data section, see ``loader``) mapped to
``ceil(numel / page_elems)`` pages by a page table, so an adapter of any rank mix costs its exact
size plus less than one page. Pages come from a best-fit contiguous run when one exists (then the
CPU path reads the weights in place, zero-copy) and from any free pages otherwise (no
fragmentation: any free page serves any adapter). Eviction is LRU over adapters that are neither
pinned nor used by the running batch.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from acelora.errors import ConfigError
from acelora_kernels.errors import AdapterInUse, AdapterNotResident, AdapterTooLarge, PoolFull
from acelora_kernels.loader import (
    AdapterPlan,
    ModuleSpec,
    copy_flat,
    fill_pages,
    module_tables,
    plan_adapter,
)

DEFAULT_PAGE_ELEMS = 4096


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What ``load`` did: bytes and pages it took, wall time, and whether it read from disk.

    >>> pool.load("legal-v1", "adapters/legal-v1")  # doctest: +SKIP
    LoadResult(name='legal-v1', bytes=2359296, pages=144, ms=3.1, cold=True)
    """

    name: str
    bytes: int
    pages: int
    ms: float
    cold: bool


@dataclass(slots=True, eq=False)
class ResidentAdapter:
    """One adapter in the pool: its page table, layout and the per-module tables the ops read."""

    name: str
    path: str
    plan: AdapterPlan
    pages: np.ndarray
    page_table: torch.Tensor
    nbytes: int
    a_off: torch.Tensor  # [num_modules] int64, element offset of lora_A in the virtual array
    b_off: torch.Tensor
    rank: torch.Tensor  # [num_modules] int32, 0 where the adapter does not target the module
    scale: torch.Tensor  # [num_modules] float32
    pinned: bool = False
    users: int = 0
    views: dict[int, tuple[torch.Tensor, torch.Tensor, float]] | None = field(default=None)


class AdapterPool:
    """Paged memory for LoRA adapters of one model: load, prefetch, LRU-evict, pin.

    >>> pool = AdapterPool.for_model(model, budget_bytes=256 << 20)  # doctest: +SKIP
    >>> pool.load("legal-v1", "adapters/legal-v1").cold  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        modules: Mapping[str, ModuleSpec],
        budget_bytes: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        page_elems: int = DEFAULT_PAGE_ELEMS,
    ) -> None:
        self.modules = dict(modules)
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_elems = int(page_elems)
        self.element_size = torch.empty((), dtype=dtype).element_size()
        page_bytes = self.page_elems * self.element_size
        if self.page_elems < 1 or budget_bytes < page_bytes:
            raise ConfigError(
                f"budget_bytes: {budget_bytes} is less than one page ({page_bytes} bytes); "
                "raise the budget or lower page_elems"
            )
        self.num_pages = int(budget_bytes // page_bytes)
        self.buffer = torch.empty(self.num_pages, self.page_elems, dtype=dtype, device=self.device)
        self._free = np.ones(self.num_pages, dtype=bool)
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()
        self._loading: dict[str, threading.Event] = {}
        self._lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._load_ms: deque[float] = deque(maxlen=256)
        self._evictions = 0

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        budget_bytes: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        page_elems: int = DEFAULT_PAGE_ELEMS,
    ) -> AdapterPool:
        """A pool sized in bytes for ``model``'s linear layers (all but the output head).

        >>> pool = AdapterPool.for_model(model, budget_bytes=1 << 30, dtype=torch.bfloat16)  # doctest: +SKIP
        >>> pool.stats()["pages_free"]  # doctest: +SKIP
        """
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
        modules = {n: ModuleSpec(i, m.in_features, m.out_features) for i, (n, m) in enumerate(linears)}
        p = next(model.parameters())
        return cls(
            modules, budget_bytes, dtype=dtype or p.dtype, device=device or p.device, page_elems=page_elems
        )

    # -- loading -------------------------------------------------------------------------------

    def load(self, name: str, path: str | os.PathLike[str]) -> LoadResult:
        """Make ``name`` resident from a PEFT directory; a resident one is only touched (warm).

        Validation and the weight copy happen before the adapter becomes visible: a failed load
        leaves the pool as it was. A different ``path`` under a resident name replaces it.

        >>> pool.load("legal-v1", "adapters/legal-v1")  # doctest: +SKIP
        >>> pool.load("legal-v1", "adapters/legal-v1").cold  # doctest: +SKIP
        False
        """
        t0 = time.perf_counter()
        path_s = os.fspath(path)
        warm = self._warm(name, path_s, t0)
        if warm is not None:
            return warm
        while True:  # one loader per name; others wait for it, then take the warm path
            with self._lock:
                pending = self._loading.get(name)
                if pending is None:
                    self._loading[name] = threading.Event()
                    break
            pending.wait()
            warm = self._warm(name, path_s, t0)
            if warm is not None:
                return warm
        try:
            return self._load_cold(name, path_s, t0)
        finally:
            with self._lock:
                self._loading.pop(name).set()

    def _warm(self, name: str, path: str, t0: float) -> LoadResult | None:
        with self._lock:
            hit = self._resident.get(name)
            if hit is None or hit.path != path:
                return None
            self._resident.move_to_end(name)
        return LoadResult(name, hit.nbytes, len(hit.pages), (time.perf_counter() - t0) * 1e3, False)

    def _load_cold(self, name: str, path: str, t0: float) -> LoadResult:
        plan = plan_adapter(Path(path), self.modules, self.dtype)
        need = -(-plan.numel // self.page_elems)
        staging = None
        with self._lock:
            self._check_replaceable(name)
            pages = self._allocate(need, plan, name, evict=False)
        if pages is None:
            # Room means evicting others: read and validate first, so a bad adapter costs nothing.
            staging = torch.empty(plan.numel, dtype=self.dtype)
            fill_pages(plan, [(0, staging)])
            with self._lock:
                pages = self._allocate(need, plan, name, evict=True)
        try:
            if staging is None:
                fill_pages(plan, self._runs(pages), self._stream)
            else:
                copy_flat(self._runs(pages), staging, self._stream)
            entry = self._entry(name, path, plan, pages)
            with self._lock:
                self._check_replaceable(name)  # a batch may have acquired the old one meanwhile
                if name in self._resident:
                    self._drop(name)
                self._resident[name] = entry
                ms = (time.perf_counter() - t0) * 1e3
                self._load_ms.append(ms)
        except BaseException:
            with self._lock:
                self._free[pages] = True
            raise
        return LoadResult(name, entry.nbytes, len(pages), ms, True)

    def _check_replaceable(self, name: str) -> None:
        old = self._resident.get(name)
        if old is not None and old.users:
            raise AdapterInUse(f"{name} is used by the running batch; reload it after the batch")

    def prefetch(self, name: str, path: str | os.PathLike[str]) -> Future[LoadResult]:
        """Load in a background thread; on CUDA through pinned staging on a side stream.

        >>> fut = pool.prefetch("legal-v1", "adapters/legal-v1")  # doctest: +SKIP
        >>> fut.result().cold  # doctest: +SKIP
        """
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acelora-prefetch")
            return self._executor.submit(self.load, name, path)

    def _allocate(self, need: int, plan: AdapterPlan, exclude: str, evict: bool) -> np.ndarray | None:
        """Take ``need`` pages, evicting LRU victims if ``evict``; None if that would be needed."""
        if need > self.num_pages:
            raise AdapterTooLarge(
                f"{plan.path}: needs {need * self.page_elems * self.element_size} bytes ({need} pages), "
                f"the pool holds {self.num_pages * self.page_elems * self.element_size}; raise budget_bytes"
            )
        free = int(self._free.sum())
        if free < need:
            victims, gain = [], 0
            for n, e in self._resident.items():
                if free + gain >= need:
                    break
                if not e.pinned and not e.users and n != exclude:
                    victims.append(n)
                    gain += len(e.pages)
            if free + gain < need:
                raise PoolFull(
                    f"{plan.path}: needs {need} pages, {free} free and only {gain} evictable "
                    "(the rest are pinned or in the running batch); unpin adapters, "
                    "wait for the batch, or raise budget_bytes"
                )
            if not evict:
                return None
            for n in victims:
                self._drop(n)
                self._evictions += 1
        pages = _best_fit_run(self._free, need)
        if pages is None:
            pages = np.flatnonzero(self._free)[:need]
        self._free[pages] = False
        return pages

    def _runs(self, pages: np.ndarray) -> list[tuple[int, torch.Tensor]]:
        """Flat buffer views over each run of consecutive pages, with their virtual start."""
        runs, flat, start, pe = [], self.buffer.view(-1), 0, self.page_elems
        for chunk in np.split(pages, np.flatnonzero(np.diff(pages) != 1) + 1):
            p0, n = int(chunk[0]), len(chunk)
            runs.append((start, flat[p0 * pe : (p0 + n) * pe]))
            start += n * pe
        return runs

    def _entry(self, name: str, path: str, plan: AdapterPlan, pages: np.ndarray) -> ResidentAdapter:
        a_off, b_off, rank, scale = module_tables(plan, len(self.modules), self.device)
        table = torch.as_tensor(pages, dtype=torch.int32, device=self.device)
        nbytes = plan.numel * self.element_size
        return ResidentAdapter(name, path, plan, pages, table, nbytes, a_off, b_off, rank, scale)

    # -- residency -----------------------------------------------------------------------------

    def evict(self, name: str) -> None:
        """Free ``name``'s pages now (pinned or not); refused while the running batch uses it.

        >>> pool.evict("legal-v1")  # doctest: +SKIP
        >>> "legal-v1" in pool  # doctest: +SKIP
        False
        """
        with self._lock:
            entry = self._get(name)
            if entry.users:
                raise AdapterInUse(f"{name} is used by the running batch; evict it after the batch")
            self._drop(name)

    def pin(self, name: str) -> None:
        """Exempt ``name`` from LRU eviction (``evict`` still removes it).

        >>> pool.pin("legal-v1")  # doctest: +SKIP
        >>> pool.stats()["pinned"]  # doctest: +SKIP
        """
        with self._lock:
            self._get(name).pinned = True

    def unpin(self, name: str) -> None:
        """Make ``name`` evictable again.

        >>> pool.unpin("legal-v1")  # doctest: +SKIP
        >>> pool.stats()["pinned"]  # doctest: +SKIP
        """
        with self._lock:
            self._get(name).pinned = False

    def __contains__(self, name: object) -> bool:
        return name in self._resident

    def resident(self) -> list[str]:
        """Resident adapter names, least recently used first.

        >>> pool.resident()  # doctest: +SKIP
        ['code-python-v2', 'legal-v1']
        """
        with self._lock:
            return list(self._resident)

    def acquire(self, names: Iterable[str]) -> list[ResidentAdapter]:
        """Mark adapters as used by the running batch (not evictable) and touch their LRU rank.

        >>> entries = pool.acquire(["legal-v1"]); pool.release(entries)  # doctest: +SKIP
        """
        with self._lock:
            entries = [self._get(n) for n in names]  # all or nothing
            for e in entries:
                e.users += 1
                self._resident.move_to_end(e.name)
            return entries

    def release(self, entries: Iterable[ResidentAdapter]) -> None:
        """Undo :meth:`acquire` once the batch is done.

        >>> pool.release(entries)  # doctest: +SKIP
        """
        with self._lock:
            for e in entries:
                e.users -= 1

    def stats(self) -> dict[str, Any]:
        """Pages used/free, utilization (adapter bytes / bytes of the pages they hold), timings.

        >>> pool.stats()["utilization"]  # doctest: +SKIP
        0.9996
        """
        with self._lock:
            used = self.num_pages - int(self._free.sum())
            adapter_bytes = sum(e.nbytes for e in self._resident.values())
            page_bytes = self.page_elems * self.element_size
            ms = list(self._load_ms)
            return {
                "page_elems": self.page_elems,
                "page_bytes": page_bytes,
                "num_pages": self.num_pages,
                "pages_used": used,
                "pages_free": self.num_pages - used,
                "bytes_capacity": self.num_pages * page_bytes,
                "bytes_used": adapter_bytes,
                "utilization": adapter_bytes / (used * page_bytes) if used else 1.0,
                "occupancy": used / self.num_pages,
                "resident": list(self._resident),
                "pinned": [n for n, e in self._resident.items() if e.pinned],
                "in_use": [n for n, e in self._resident.items() if e.users],
                "cold_loads": len(ms),
                "load_ms_last": ms[-1] if ms else None,
                "load_ms_mean": sum(ms) / len(ms) if ms else None,
                "evictions": self._evictions,
                "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device),
            }

    def _get(self, name: str) -> ResidentAdapter:
        entry = self._resident.get(name)
        if entry is None:
            raise AdapterNotResident(
                f"{name} is not loaded in the pool; call pool.load({name!r}, path) first"
            )
        return entry

    def _drop(self, name: str) -> None:
        entry = self._resident.pop(name)
        entry.views = None
        self._free[entry.pages] = True

    def close(self) -> None:
        """Stop the prefetch thread (pending prefetches finish first).

        >>> pool.close()  # doctest: +SKIP
        """
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _best_fit_run(free: np.ndarray, need: int) -> np.ndarray | None:
    """Pages of the smallest run of free pages that holds ``need``, or None."""
    edges = np.diff(np.concatenate(([0], free.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    lens = ends - starts
    ok = np.flatnonzero(lens >= need)
    if not ok.size:
        return None
    best = ok[np.argmin(lens[ok])]
    return np.arange(starts[best], starts[best] + need)

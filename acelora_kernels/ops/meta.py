"""Batch metadata for the LoRA ops, built once per forward and shared by every layer.

A batch has ``B`` rows of ``T`` tokens (``T == 1`` in decode); row ``b`` uses adapter *slot*
``row_slot[b]`` (``-1`` = base model). From that we derive once:

- per-token slots (BGMV), segments of consecutive tokens with one adapter (SGMV), and per-slot
  token groups (a slice when the slot's rows are contiguous, else an index tensor);
- for the torch path, each slot's ``(lora_A, lora_B, scaling)`` per module, read from the pages;
- for the Triton path, the slots' page tables and per-module offset/rank/scale tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from acelora_kernels.pool import AdapterPool, ResidentAdapter

Views = dict[int, tuple[torch.Tensor, torch.Tensor, float]]


@dataclass(slots=True)
class LoraBatchMeta:
    """What every LoRA layer of one forward needs to know about the batch.

    >>> meta = build_meta(pool, entries, row_slot=[0, -1, 1], tokens_per_row=1, backend="torch")  # doctest: +SKIP
    >>> meta.max_rank[module_index]  # doctest: +SKIP
    """

    backend: str
    num_tokens: int
    tokens_per_row: int
    num_modules: int
    max_rank: list[int]  # per module: the widest rank any adapter of the batch has there (0: none)
    token_slot: torch.Tensor  # [N] int32
    segments: list[tuple[int, int, int]]  # (start, end, slot) over adapter tokens only
    seg_start: torch.Tensor  # [S] int32
    seg_end: torch.Tensor  # [S] int32 (base rows between segments belong to none)
    seg_slot: torch.Tensor  # [S] int32
    max_seg_len: int
    groups: list[tuple[int, slice | torch.Tensor]]  # per slot: its tokens
    max_group_tokens: int  # tokens of the largest group (sizes the torch path's threading)
    views: list[Views] | None = None
    buffer: torch.Tensor | None = None
    page_elems: int = 0
    page_table: torch.Tensor | None = None  # [num_slots, max_pages] int32
    a_off: torch.Tensor | None = None  # [num_slots, num_modules] int64
    b_off: torch.Tensor | None = None
    rank: torch.Tensor | None = None  # [num_slots, num_modules] int32
    scale: torch.Tensor | None = None  # [num_slots, num_modules] float32

    @property
    def empty(self) -> bool:
        """True when no row of the batch uses an adapter (the layers then do nothing)."""
        return not self.groups


def build_meta(
    pool: AdapterPool, entries: list[ResidentAdapter], row_slot: list[int], tokens_per_row: int, backend: str
) -> LoraBatchMeta:
    """Derive :class:`LoraBatchMeta` for ``len(row_slot)`` rows of ``tokens_per_row`` tokens."""
    t, dev = tokens_per_row, pool.device
    n = len(row_slot) * t
    runs: list[tuple[int, int, int]] = []  # merged runs of rows with one slot, in tokens
    for b, slot in enumerate(row_slot):
        if runs and runs[-1][2] == slot and runs[-1][1] == b * t:
            runs[-1] = (runs[-1][0], (b + 1) * t, slot)
        else:
            runs.append((b * t, (b + 1) * t, slot))
    segments = [r for r in runs if r[2] >= 0]
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot in range(len(entries)):
        mine = [(s, e) for s, e, k in segments if k == slot]
        if len(mine) == 1:
            groups.append((slot, slice(*mine[0])))
        elif mine:
            idx = torch.cat([torch.arange(s, e) for s, e in mine]).to(dev)
            groups.append((slot, idx))
    num_modules = len(pool.modules)
    rank = (
        torch.stack([e.rank for e in entries]) if entries else torch.zeros(0, num_modules, dtype=torch.int32)
    )
    max_rank = rank.amax(0).tolist() if entries else [0] * num_modules
    token_slot = torch.tensor(row_slot, dtype=torch.int32).repeat_interleave(t).to(dev)
    seg_start = torch.tensor([s for s, _, _ in segments], dtype=torch.int32, device=dev)
    seg_end = torch.tensor([e for _, e, _ in segments], dtype=torch.int32, device=dev)
    meta = LoraBatchMeta(
        backend=backend,
        num_tokens=n,
        tokens_per_row=t,
        num_modules=num_modules,
        max_rank=max_rank,
        token_slot=token_slot,
        segments=segments,
        seg_start=seg_start,
        seg_end=seg_end,
        seg_slot=torch.tensor([k for _, _, k in segments], dtype=torch.int32, device=dev),
        max_seg_len=max((e - s for s, e, _ in segments), default=0),
        groups=groups,
        max_group_tokens=max((sum(e - s for s, e, k in segments if k == g) for g, _ in groups), default=0),
    )
    if backend == "torch":
        meta.views = [adapter_views(pool, e) for e in entries]
    else:
        max_pages = max((len(e.pages) for e in entries), default=1)
        table = torch.zeros(max(len(entries), 1), max_pages, dtype=torch.int32, device=dev)
        for i, e in enumerate(entries):
            table[i, : len(e.pages)] = e.page_table
        meta.buffer, meta.page_elems, meta.page_table, meta.rank = pool.buffer, pool.page_elems, table, rank
        if entries:
            meta.a_off = torch.stack([e.a_off for e in entries])
            meta.b_off = torch.stack([e.b_off for e in entries])
            meta.scale = torch.stack([e.scale for e in entries])
    return meta


def adapter_views(pool: AdapterPool, entry: ResidentAdapter) -> Views:
    """Per module index: ``(lora_A [r, d_in], lora_B [d_out, r], scaling)`` read from the pages.

    Zero-copy views of the pool buffer when the adapter's pages are one run (the usual case, see
    the pool's best-fit allocation); otherwise one gathered copy. Cached on the entry, which the
    pool clears on eviction; callers hold the adapter (``pool.acquire``) so it cannot go meanwhile.

    >>> views = adapter_views(pool, pool.acquire(["legal-v1"])[0])  # doctest: +SKIP
    >>> a, b, scaling = views[module_index]  # doctest: +SKIP
    """
    if entry.views is None:
        pages = entry.pages
        if pages[-1] - pages[0] + 1 == len(pages):
            pe = pool.page_elems
            flat = pool.buffer.view(-1)[int(pages[0]) * pe : (int(pages[-1]) + 1) * pe]
        else:
            flat = pool.buffer[entry.page_table.long()].view(-1)
        entry.views = {
            s.index: (
                flat[s.a_off : s.a_off + s.rank * s.in_features].view(s.rank, s.in_features),
                flat[s.b_off : s.b_off + s.rank * s.out_features].view(s.out_features, s.rank),
                s.scaling,
            )
            for s in entry.plan.modules
        }
    return entry.views

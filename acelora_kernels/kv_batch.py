"""The running batch's KV cache: per layer ``[B, heads, T, head_dim]``, left-padded, with a ``[B, T]`` mask.

Rows join after their own prefill (both sides are left-padded to a common width, padding masked
out) and leave when they finish (rows dropped, then columns that are padding in every remaining row).
Positions are per row, so padding never shifts a sequence's rotary positions.
"""

from __future__ import annotations

from typing import Any

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]


class KVBatch:
    """Left-padded K/V tensors of every layer plus the attention mask, rows in batch order.

    >>> b = KVBatch(); len(b)
    0
    """

    def __init__(self) -> None:
        self.kv: KV = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)

    def __len__(self) -> int:
        return self.mask.shape[0]

    def extend(self, kv: KV, mask: torch.Tensor) -> None:
        """Append rows (``kv`` and ``mask`` from their prefill) below the current ones."""
        if not len(self):
            self.kv, self.mask = kv, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.kv = [
            (torch.cat([_lpad(k0, width), _lpad(k1, width)]), torch.cat([_lpad(v0, width), _lpad(v1, width)]))
            for (k0, v0), (k1, v1) in zip(self.kv, kv, strict=True)
        ]
        self.mask = torch.cat([_lpad(self.mask, width), _lpad(mask, width)])

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order) and trim all-padding columns on the left."""
        if not keep:
            self.kv, self.mask = [], torch.zeros(0, 0, dtype=torch.long)
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).long().argmax())
        self.mask = mask[:, first:]
        self.kv = [
            (k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in self.kv
        ]

    def step_mask(self) -> torch.Tensor:
        """The mask for one more token per row (what a decode step attends over)."""
        return torch.cat(
            [self.mask, torch.ones(len(self), 1, dtype=self.mask.dtype, device=self.mask.device)], dim=1
        )

    def update(self, kv: KV, mask: torch.Tensor) -> None:
        """Take the cache a decode step returned."""
        self.kv, self.mask = kv, mask


def select_rows(kv: KV, mask: torch.Tensor, keep: list[int]) -> tuple[KV, torch.Tensor]:
    """Rows ``keep`` of a prefill's cache (drops sequences that finished in their prefill)."""
    idx = torch.tensor(keep, dtype=torch.long, device=mask.device)
    return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv], mask.index_select(0, idx)


def make_cache(kv: KV) -> Any:
    """A ``transformers`` DynamicCache holding ``kv`` (empty for a prefill)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()


def cache_tensors(cache: Any) -> KV:
    """``[(keys, values)]`` per layer of a DynamicCache after a forward (transformers 4.x or 5.x)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence axis (1 for a mask, 2 for K/V) with zeros up to ``width``."""
    axis = 1 if t.dim() == 2 else 2
    missing = width - t.shape[axis]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t.new_zeros(shape), t], dim=axis)

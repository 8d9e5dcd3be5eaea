"""Torch reference of the multi-adapter LoRA ops: the CPU path and the oracle for the Triton kernels.

``shrink`` computes ``y = scaling * x @ lora_Aᵀ`` (a rank-r vector per token), ``expand`` adds
``y @ lora_Bᵀ`` to the base layer's output. BGMV walks per-adapter token groups (decode), SGMV
walks segments of consecutive tokens (prefill). Weights come from ``meta.views``: per-adapter
views of the pool pages, zero-copy when an adapter's pages are contiguous. ``y`` is
``[N, max_rank]``; a token only fills the first ``rank`` columns of its adapter, base tokens stay 0.
"""

from __future__ import annotations

import torch

from acelora_kernels.ops.meta import LoraBatchMeta


def bgmv_shrink(x: torch.Tensor, meta: LoraBatchMeta, module: int) -> torch.Tensor:
    """Per-token shrink: ``y[t, :r] = scaling * x[t] @ A_{slot(t)}ᵀ``.

    >>> y = bgmv_shrink(x, meta, module=3)  # doctest: +SKIP
    >>> y.shape == (x.shape[0], meta.max_rank[3])  # doctest: +SKIP
    """
    y = x.new_zeros(x.shape[0], meta.max_rank[module])
    for slot, rows in meta.groups:
        w = meta.views[slot].get(module)
        if w is not None:
            a, _, s = w
            y[rows, : a.shape[0]] = (_rows(x, rows).to(a.dtype) @ a.t()).mul_(s).to(y.dtype)
    return y


def bgmv_expand(y: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """Per-token expand, in place: ``out[t] += y[t, :r] @ B_{slot(t)}ᵀ``.

    >>> bgmv_expand(bgmv_shrink(x, meta, 3), out, meta, module=3)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    for slot, rows in meta.groups:
        w = meta.views[slot].get(module)
        if w is not None:
            b = w[1]
            _add_rows(out, rows, _rows(y, rows)[:, : b.shape[1]].to(b.dtype) @ b.t())


def sgmv_shrink(x: torch.Tensor, meta: LoraBatchMeta, module: int) -> torch.Tensor:
    """Per-segment shrink over runs of consecutive tokens that share an adapter (prefill).

    >>> y = sgmv_shrink(x, meta, module=3)  # doctest: +SKIP
    >>> torch.equal(y, bgmv_shrink(x, meta, 3))  # doctest: +SKIP
    """
    y = x.new_zeros(x.shape[0], meta.max_rank[module])
    for start, end, slot in meta.segments:
        w = meta.views[slot].get(module)
        if w is not None:
            a, _, s = w
            y[start:end, : a.shape[0]] = (x[start:end].to(a.dtype) @ a.t()).mul_(s).to(y.dtype)
    return y


def sgmv_expand(y: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """Per-segment expand, in place.

    >>> sgmv_expand(sgmv_shrink(x, meta, 3), out, meta, module=3)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    for start, end, slot in meta.segments:
        w = meta.views[slot].get(module)
        if w is not None:
            b = w[1]
            _add_rows(out, slice(start, end), y[start:end, : b.shape[1]].to(b.dtype) @ b.t())


def add_lora(x: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """``out += scaling * x @ Aᵀ @ Bᵀ`` per token's adapter, fused per adapter group (fast CPU path).

    One shrink GEMM and one expand GEMM per distinct adapter: each adapter's weights are read once
    per layer whatever its row positions, and contiguous rows need no gather.

    >>> add_lora(x.view(-1, 64), out.view(-1, 64), meta, module=3)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    x_rows: tuple[torch.Tensor, ...] = ()
    out_rows: tuple[torch.Tensor, ...] = ()
    for slot, rows in meta.groups:
        w = meta.views[slot].get(module)
        if w is None:
            continue
        a, b, s = w
        fast = x.dtype == a.dtype == out.dtype
        if fast and isinstance(rows, slice) and rows.stop - rows.start == 1:
            # one decode token: two GEMVs on row views (fewer dispatches than slicing + GEMM)
            if not x_rows:
                x_rows, out_rows = x.unbind(0), out.unbind(0)
            out_rows[rows.start].addmv_(b, torch.mv(a, x_rows[rows.start]), alpha=s)
        elif fast and isinstance(rows, slice):
            out[rows].addmm_(x[rows] @ a.t(), b.t(), alpha=s)
        else:
            _add_rows(out, rows, ((_rows(x, rows).to(a.dtype) @ a.t()) @ b.t()).mul_(s))


def _rows(t: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _add_rows(out: torch.Tensor, rows: slice | torch.Tensor, delta: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] += delta.to(out.dtype)
    else:
        out.index_add_(0, rows, delta.to(out.dtype))

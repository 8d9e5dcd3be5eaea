"""Triton kernels of the multi-adapter LoRA ops, reading weights straight from the pool's pages.

Same functions and signatures as ``torch_ref``. An element at virtual offset ``v`` of an adapter
in batch slot ``s`` lives at ``page_table[s, v // P] * P + v % P`` of the flat page buffer;
``lora_A`` is ``[r, d_in]`` at ``a_off[s, module]``, ``lora_B`` ``[d_out, r]`` at ``b_off``.
Rank 0 (base rows, untargeted modules) masks a program's work away. Accumulation is fp32 and
operands are cast to fp32 before ``tl.dot`` (required by ``TRITON_INTERPRET=1``, which the tests
use on CPU, and ``input_precision="ieee"`` keeps CUDA results equal to the torch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from acelora_kernels.ops.meta import LoraBatchMeta

BLOCK_K = 64
BLOCK_N = 64
BLOCK_M = 16


@triton.jit
def _paged(buf_ptr, pt_row_ptr, v, mask, P):
    """Load elements at virtual offsets ``v`` of one adapter through its page-table row."""
    page = tl.load(pt_row_ptr + v // P, mask=mask, other=0).to(tl.int64)
    return tl.load(buf_ptr + page * P + v % P, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _bgmv_shrink_kernel(x_ptr, y_ptr, buf_ptr, pt_ptr, tok_slot_ptr, off_ptr, rank_ptr, scale_ptr,
                        d_in, x_stride, y_stride, pt_stride, num_modules, module, P,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(tok_slot_ptr + t)
    s = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(rank_ptr + s * num_modules + module), 0)
    a_off = tl.load(off_ptr + s * num_modules + module)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = offs_k < d_in
        x = tl.load(x_ptr + t * x_stride + offs_k, mask=km, other=0.0).to(tl.float32)
        m = (offs_r[:, None] < rank) & km[None, :]
        a = _paged(buf_ptr, pt_ptr + s * pt_stride, a_off + offs_r[:, None].to(tl.int64) * d_in + offs_k[None, :],
                   m, P)  # fmt: skip
        acc += tl.sum(a * x[None, :], axis=1)
    scale = tl.load(scale_ptr + s * num_modules + module)
    y = (acc * scale).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * y_stride + offs_r, y, mask=offs_r < rank)


@triton.jit
def _bgmv_expand_kernel(y_ptr, out_ptr, buf_ptr, pt_ptr, tok_slot_ptr, off_ptr, rank_ptr,
                        d_out, y_stride, out_stride, pt_stride, num_modules, module, P,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(tok_slot_ptr + t)
    s = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.load(rank_ptr + s * num_modules + module), 0)
    b_off = tl.load(off_ptr + s * num_modules + module)
    offs_r = tl.arange(0, BLOCK_R)
    y = tl.load(y_ptr + t * y_stride + offs_r, mask=offs_r < rank, other=0.0).to(tl.float32)
    m = (offs_n[:, None] < d_out) & (offs_r[None, :] < rank)
    b = _paged(
        buf_ptr, pt_ptr + s * pt_stride, b_off + offs_n[:, None].to(tl.int64) * rank + offs_r[None, :], m, P
    )
    nm = offs_n < tl.where(rank > 0, d_out, 0)
    o = tl.load(out_ptr + t * out_stride + offs_n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * out_stride + offs_n, (o + tl.sum(b * y[None, :], axis=1)).to(out_ptr.dtype.element_ty),
             mask=nm)  # fmt: skip


@triton.jit
def _sgmv_shrink_kernel(x_ptr, y_ptr, buf_ptr, pt_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr, off_ptr, rank_ptr, scale_ptr,
                        d_in, x_stride, y_stride, pt_stride, num_modules, module, P,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_end_ptr + seg)
    s = tl.load(seg_slot_ptr + seg)
    rank = tl.load(rank_ptr + s * num_modules + module)
    a_off = tl.load(off_ptr + s * num_modules + module)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < tl.where(rank > 0, end, 0)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        km = offs_k < d_in
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
                    mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)  # fmt: skip
        at_mask = km[:, None] & (offs_r[None, :] < rank)  # A transposed: [BLOCK_K, BLOCK_R]
        at = _paged(buf_ptr, pt_ptr + s * pt_stride, a_off + offs_r[None, :].to(tl.int64) * d_in + offs_k[:, None],
                    at_mask, P)  # fmt: skip
        acc += tl.dot(x, at, input_precision="ieee")
    scale = tl.load(scale_ptr + s * num_modules + module)
    y = (acc * scale).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * y_stride + offs_r[None, :], y,
             mask=mm[:, None] & (offs_r[None, :] < rank))  # fmt: skip


@triton.jit
def _sgmv_expand_kernel(y_ptr, out_ptr, buf_ptr, pt_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr, off_ptr, rank_ptr,
                        d_out, y_stride, out_stride, pt_stride, num_modules, module, P,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_end_ptr + seg)
    s = tl.load(seg_slot_ptr + seg)
    rank = tl.load(rank_ptr + s * num_modules + module)
    b_off = tl.load(off_ptr + s * num_modules + module)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mm = offs_m < tl.where(rank > 0, end, 0)
    y = tl.load(y_ptr + offs_m[:, None].to(tl.int64) * y_stride + offs_r[None, :],
                mask=mm[:, None] & (offs_r[None, :] < rank), other=0.0).to(tl.float32)  # fmt: skip
    bt_mask = (offs_r[:, None] < rank) & (offs_n[None, :] < d_out)  # B transposed: [BLOCK_R, BLOCK_N]
    bt = _paged(buf_ptr, pt_ptr + s * pt_stride, b_off + offs_n[None, :].to(tl.int64) * rank + offs_r[:, None],
                bt_mask, P)  # fmt: skip
    acc = tl.dot(y, bt, input_precision="ieee")
    om = mm[:, None] & (offs_n[None, :] < d_out)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    o = tl.load(ptrs, mask=om, other=0.0).to(tl.float32)
    tl.store(ptrs, (o + acc).to(out_ptr.dtype.element_ty), mask=om)


def _block_r(meta: LoraBatchMeta, module: int) -> int:
    return max(16, triton.next_power_of_2(meta.max_rank[module]))


def _common(meta: LoraBatchMeta, module: int) -> tuple:
    return meta.page_table.stride(0), meta.num_modules, module, meta.page_elems


def bgmv_shrink(x: torch.Tensor, meta: LoraBatchMeta, module: int) -> torch.Tensor:
    """Per-token shrink, one program per token: ``y[t, :r] = scaling * x[t] @ A_{slot(t)}ᵀ``.

    >>> y = bgmv_shrink(x, meta, module=3)  # doctest: +SKIP
    >>> torch.testing.assert_close(y, torch_ref.bgmv_shrink(x, meta_torch, 3))  # doctest: +SKIP
    """
    x = x.contiguous()
    y = x.new_zeros(x.shape[0], meta.max_rank[module])
    _bgmv_shrink_kernel[(x.shape[0],)](
        x, y, meta.buffer, meta.page_table, meta.token_slot, meta.a_off, meta.rank, meta.scale,
        x.shape[1], x.stride(0), y.stride(0), *_common(meta, module),
        BLOCK_R=_block_r(meta, module), BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y


def bgmv_expand(y: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """Per-token expand, in place: ``out[t] += y[t, :r] @ B_{slot(t)}ᵀ``.

    >>> bgmv_expand(bgmv_shrink(x, meta, 3), out, meta, module=3)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    assert out.stride(1) == 1, "out must be row-contiguous"
    y = y.contiguous()
    grid = (out.shape[0], triton.cdiv(out.shape[1], BLOCK_N))
    _bgmv_expand_kernel[grid](
        y, out, meta.buffer, meta.page_table, meta.token_slot, meta.b_off, meta.rank,
        out.shape[1], y.stride(0), out.stride(0), *_common(meta, module),
        BLOCK_R=_block_r(meta, module), BLOCK_N=BLOCK_N,
    )  # fmt: skip


def sgmv_shrink(x: torch.Tensor, meta: LoraBatchMeta, module: int) -> torch.Tensor:
    """Per-segment shrink: one program per (segment, block of its tokens), ``tl.dot`` over d_in.

    >>> y = sgmv_shrink(x, meta, module=3)  # doctest: +SKIP
    >>> torch.testing.assert_close(y, torch_ref.sgmv_shrink(x, meta_torch, 3))  # doctest: +SKIP
    """
    x = x.contiguous()
    y = x.new_zeros(x.shape[0], meta.max_rank[module])
    if meta.segments:
        grid = (len(meta.segments), triton.cdiv(meta.max_seg_len, BLOCK_M))
        _sgmv_shrink_kernel[grid](
            x, y, meta.buffer, meta.page_table, meta.seg_start, meta.seg_end, meta.seg_slot, meta.a_off, meta.rank, meta.scale,
            x.shape[1], x.stride(0), y.stride(0), *_common(meta, module),
            BLOCK_M=BLOCK_M, BLOCK_R=_block_r(meta, module), BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return y


def sgmv_expand(y: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """Per-segment expand, in place.

    >>> sgmv_expand(sgmv_shrink(x, meta, 3), out, meta, module=3)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    assert out.stride(1) == 1, "out must be row-contiguous"
    if not meta.segments:
        return
    y = y.contiguous()
    grid = (len(meta.segments), triton.cdiv(meta.max_seg_len, BLOCK_M), triton.cdiv(out.shape[1], BLOCK_N))
    _sgmv_expand_kernel[grid](
        y, out, meta.buffer, meta.page_table, meta.seg_start, meta.seg_end, meta.seg_slot, meta.b_off, meta.rank,
        out.shape[1], y.stride(0), out.stride(0), *_common(meta, module),
        BLOCK_M=BLOCK_M, BLOCK_R=_block_r(meta, module), BLOCK_N=BLOCK_N,
    )  # fmt: skip


def add_lora(x: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """Shrink then expand: BGMV for decode batches (one token per row), SGMV for prefill.

    >>> add_lora(x.view(-1, 64), out.view(-1, 64), meta, module=3)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    if meta.tokens_per_row == 1:
        bgmv_expand(bgmv_shrink(x, meta, module), out, meta, module)
    else:
        sgmv_expand(sgmv_shrink(x, meta, module), out, meta, module)

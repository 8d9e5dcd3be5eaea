"""Multi-adapter LoRA ops: one dispatcher over the torch reference and the Triton kernels.

Both backends expose the same functions (``bgmv_shrink``, ``bgmv_expand``, ``sgmv_shrink``,
``sgmv_expand``, ``add_lora``); the layers only call :func:`add_lora` with the batch's
:class:`LoraBatchMeta`, whose ``backend`` was chosen once per batch by :func:`pick_backend`:
Triton on CUDA, torch elsewhere; ``ACELORA_KERNELS_BACKEND=torch|triton`` forces either.
The Triton module is imported only when chosen (``TRITON_INTERPRET`` must be set before it is).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from acelora_kernels.ops import cpu, torch_ref
from acelora_kernels.ops.meta import LoraBatchMeta, build_meta

BACKEND_ENV = "ACELORA_KERNELS_BACKEND"
BACKENDS = ("torch", "triton")

__all__ = ["BACKEND_ENV", "LoraBatchMeta", "add_lora", "backend_module", "build_meta", "pick_backend"]


def pick_backend(device: torch.device | str) -> str:
    """``"triton"`` on CUDA when Triton imports, else ``"torch"``; the env var overrides.

    >>> pick_backend("cpu")
    'torch'
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={forced!r}: expected one of {', '.join(BACKENDS)}")
        return forced
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return "torch"


def backend_module(name: str) -> ModuleType:
    """The module implementing backend ``name`` (same function names and signatures in both).

    >>> backend_module("torch").__name__
    'acelora_kernels.ops.torch_ref'
    """
    if name == "torch":
        return torch_ref
    if name == "triton":
        from acelora_kernels.ops import triton_ops

        return triton_ops
    raise ValueError(f"unknown ops backend {name!r}: expected one of {', '.join(BACKENDS)}")


def add_lora(x: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """Add every token's adapter delta for linear ``module`` to ``out`` (``[N, d_out]``), in place.

    >>> add_lora(x.view(-1, d_in), out.view(-1, d_out), meta, module=5)  # doctest: +SKIP
    >>> out  # base output + scaling * x @ Aᵀ @ Bᵀ per row's adapter  # doctest: +SKIP
    """
    if meta.empty or not meta.max_rank[module]:
        return
    if meta.backend == "torch" and x.device.type == "cpu":
        cpu.add_lora(x, out, meta, module)
    else:
        backend_module(meta.backend).add_lora(x, out, meta, module)

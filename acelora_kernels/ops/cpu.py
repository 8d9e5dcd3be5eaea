"""How the torch path uses a CPU: LoRA GEMMs of one adapter group run on a single thread.

Measured on 2 cores (benchmarks/kernels.py, docs/benchmarks.md "Kernels"): a decode step with 32
adapters is ~450 GEMVs per layer and a prefill a few hundred skinny GEMMs (rank 16). Left to
OpenMP, each is a parallel region that gains little on 2 threads, and on a busy machine a
descheduled thread stalls a region for a whole scheduler tick (4 ms): prefill 8x128 with 8
adapters measured +22% over base that way, +1..5% single-threaded. Splitting the adapter groups
over worker threads instead was measured too, and lost (+9.5% vs +8.5% for 32 adapters) once
another process held a core, so it is not done.
"""

from __future__ import annotations

import torch

from acelora_kernels.ops import torch_ref
from acelora_kernels.ops.meta import LoraBatchMeta

SINGLE_THREAD_MACS = 1 << 25  # per adapter group; larger GEMMs keep torch's own threading


def add_lora(x: torch.Tensor, out: torch.Tensor, meta: LoraBatchMeta, module: int) -> None:
    """CPU scheduling of :func:`torch_ref.add_lora` (same result, same signature).

    ``torch.set_num_threads`` is process-wide: another thread's torch ops that start during the
    call also run on one thread (the engine's prefetch thread only copies bytes).

    >>> add_lora(x.view(-1, 4096), out.view(-1, 4096), meta, module=0)  # doctest: +SKIP
    >>> out  # base output + LoRA delta  # doctest: +SKIP
    """
    threads = torch.get_num_threads()
    macs = meta.max_group_tokens * meta.max_rank[module] * (x.shape[-1] + out.shape[-1])
    if threads == 1 or macs > SINGLE_THREAD_MACS:
        torch_ref.add_lora(x, out, meta, module)
        return
    torch.set_num_threads(1)
    try:
        torch_ref.add_lora(x, out, meta, module)
    finally:
        torch.set_num_threads(threads)

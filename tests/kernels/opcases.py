"""Helpers shared by the op tests (torch, and Triton under the interpreter): a loaded pool, a batch
metadata, and the dense per-token oracle computed from the adapters' safetensors files."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from acelora.peft_format import read_config
from acelora_kernels.ops import build_meta
from acelora_kernels.pool import AdapterPool

ROWS = ["r16-patterns", None, "r4-attn", "r16-patterns", "r64-rslora", "r4-attn", None]


def loaded_pool(model, adapter_dirs, page_elems: int = 100, fragment: bool = False) -> AdapterPool:
    """A pool holding the test adapters; ``fragment`` leaves r64-rslora on scattered pages."""
    pool = AdapterPool.for_model(model, budget_bytes=(3 if fragment else 8) << 20, page_elems=page_elems)
    if fragment:  # fill, free every other filler: no run is long enough for the big adapter
        need = -(-pool.load("probe", adapter_dirs["r64-rslora"]).bytes // (page_elems * 4))
        pool.evict("probe")
        small = -(-pool.load("f0", adapter_dirs["r32-mlp"]).bytes // (page_elems * 4))
        i = 1
        while pool.stats()["pages_free"] >= small:
            pool.load(f"f{i}", adapter_dirs["r32-mlp"])
            i += 1
        for j in range(0, i, 2):
            pool.evict(f"f{j}")
        assert pool.stats()["pages_free"] >= need
    for name, path in adapter_dirs.items():
        pool.load(name, path)
    if fragment:
        (big,) = pool.acquire(["r64-rslora"])
        pool.release([big])
        assert big.pages[-1] - big.pages[0] + 1 > len(big.pages), "expected scattered pages"
    return pool


def meta_for(pool: AdapterPool, rows: list[str | None], tokens_per_row: int, backend: str):
    distinct = list(dict.fromkeys(n for n in rows if n))
    entries = pool.acquire(distinct)
    slot = {n: i for i, n in enumerate(distinct)}
    return build_meta(pool, entries, [slot[n] if n else -1 for n in rows], tokens_per_row, backend)


def dense_delta(adapter_dirs, rows, tokens_per_row: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """``scaling * x @ Aᵀ @ Bᵀ`` token by token, straight from the files: the oracle."""
    out, files = [], {n: load_file(adapter_dirs[n] / "adapter_model.safetensors") for n in set(rows) if n}
    key = f"base_model.model.{module}.lora_A.weight"
    for t in range(x.shape[0]):
        name = rows[t // tokens_per_row]
        tensors = files[name] if name else {}
        if key not in tensors:
            out.append(None)
            continue
        a, b = tensors[key].double(), tensors[key.replace("lora_A", "lora_B")].double()
        out.append(read_config(adapter_dirs[name]).scaling_for(module) * (x[t].double() @ a.t() @ b.t()))
    d_out = next(o.shape[0] for o in out if o is not None)
    return torch.stack([o if o is not None else torch.zeros(d_out, dtype=torch.float64) for o in out]).float()

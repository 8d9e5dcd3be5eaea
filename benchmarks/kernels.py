"""Benchmarks of acelora_kernels on this machine, each a ratio measured side by side in one process.

- decode step (batch 32, one token per row) with 1/8/32 distinct rank-16 all-linear adapters, and
  prefill (8 x 128 tokens, a different adapter per row), through the seven linears of one
  Llama-7B-dims decoder layer: ours vs the base linears alone vs PEFT's mixed-batch path
  (``model(x, adapter_names=[...])``); overheads are medians of per-rep paired ratios;
- pool utilization for a mix of ranks {8, 16, 32, 64} vs padding every slot to the max rank;
- cold load (safetensors -> pool pages) bandwidth vs a plain memcpy of the same bytes;
- warm re-activation (``pool.load`` of a resident adapter).

    python benchmarks/kernels.py            # full run, a few minutes on 2 cores
    python benchmarks/kernels.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from acelora_kernels.layers import attach, lora_batch
from acelora_kernels.loader import ModuleSpec
from acelora_kernels.pool import AdapterPool

HIDDEN, INTER, KV = 4096, 11008, 1024
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
          "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}  # fmt: skip


class DecoderLinears(nn.Module):
    """The seven linear layers of one Llama-7B decoder layer, named as in transformers."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        for name, (d_in, d_out) in SHAPES.items():
            lin = torch.nn.utils.skip_init(nn.Linear, d_in, d_out, bias=False)
            lin.weight.data.normal_(0, 0.02)
            setattr(self.self_attn if name in ATTN else self.mlp, name, lin)

    def forward(self, h: torch.Tensor, inter: torch.Tensor) -> list[torch.Tensor]:
        a, m = self.self_attn, self.mlp
        outs = [getattr(a, n)(h) for n in ATTN]
        return outs + [m.gate_proj(h), m.up_proj(h), m.down_proj(inter)]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLinears()])

    def forward(self, h: torch.Tensor, inter: torch.Tensor) -> list[torch.Tensor]:
        return self.layers[0](h, inter)


def module_names(layers: int = 1) -> dict[str, tuple[int, int]]:
    """``layers.{i}.self_attn.q_proj`` ... -> (d_in, d_out), as named in a Llama decoder stack."""
    return {f"layers.{i}.{'self_attn' if n in ATTN else 'mlp'}.{n}": shape
            for i in range(layers) for n, shape in SHAPES.items()}  # fmt: skip


def write_adapter(out: Path, rank: int, seed: int, layers: int = 1) -> Path:
    """A PEFT-format LoRA directory (config + safetensors) targeting all seven linears per layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (d_in, d_out) in module_names(layers).items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.01
        tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SHAPES),
              "lora_dropout": 0.0, "bias": "none", "task_type": None}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def side_by_side(
    fns: dict[str, Callable[[], object]], reps: int
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Interleave the variants rep by rep so that load from other processes hits them alike.

    Returns the median ms of each variant and the raw per-rep samples (for paired ratios).
    """
    for fn in fns.values():
        fn()  # warm-up: lazy views, allocator, page faults
    samples = []
    for _ in range(reps):
        rep = {}
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            rep[k] = (time.perf_counter() - t0) * 1e3
        samples.append(rep)
    return {k: statistics.median(r[k] for r in samples) for k in fns}, samples


def measure(model: nn.Module, peft: nn.Module, h: torch.Tensor, inter: torch.Tensor,
            configs: dict[int, list[str]], reps: int) -> dict[int, dict[str, float]]:  # fmt: skip
    """Base linears vs ours (lora_batch) vs PEFT's mixed batch for each adapter count, all
    interleaved in every rep; overhead = median over reps of the paired ratio to that rep's base."""

    def ours(names: list[str]) -> object:
        with lora_batch(model, names):
            return model(h, inter)

    fns: dict[str, Callable[[], object]] = {}
    for n, names in configs.items():
        fns[f"{n}/base"] = lambda: model(h, inter)
        fns[f"{n}/ours"] = partial(ours, names)
        fns[f"{n}/peft"] = partial(peft, h, inter, adapter_names=names)
    ms, samples = side_by_side(fns, reps)
    out = {}
    for n in configs:
        over = {
            k: statistics.median(r[f"{n}/{k}"] / r[f"{n}/base"] - 1 for r in samples)
            for k in ("ours", "peft")
        }
        out[n] = {**{f"{k}_ms": ms[f"{n}/{k}"] for k in ("base", "ours", "peft")},
                  "ours_overhead": over["ours"], "peft_overhead": over["peft"],
                  "ours_vs_peft_overhead": over["ours"] / over["peft"] if over["peft"] > 0 else float("nan")}  # fmt: skip
    return out


def bench_forward(root: Path, counts: list[int], batch: int, reps: int, prefill: tuple[int, int],
                  prefill_reps: int) -> list[dict]:  # fmt: skip
    from peft import PeftModel

    model = Layer().eval()
    n_max = max(counts)
    dirs = [write_adapter(root / f"r16-{i}", 16, seed=i) for i in range(n_max)]
    pool = AdapterPool.for_model(model, budget_bytes=n_max * 5 << 20)
    for i, d in enumerate(dirs):
        pool.load(f"a{i}", d)
    attach(model, pool)
    peft_base = Layer().eval()
    peft_base.load_state_dict(model.state_dict())
    peft = PeftModel.from_pretrained(peft_base, str(dirs[0]), adapter_name="a0")
    for i, d in enumerate(dirs[1:], start=1):
        peft.load_adapter(str(d), adapter_name=f"a{i}")
    peft.eval()
    rows = []
    shapes = [
        ("decode", batch, 1, reps, counts),
        ("prefill", *prefill, prefill_reps, [min(n_max, prefill[0])]),
    ]
    for kind, b, t, r, ns in shapes:
        gen = torch.Generator().manual_seed(0)
        h, inter = torch.randn(b, t, HIDDEN, generator=gen), torch.randn(b, t, INTER, generator=gen)
        results = measure(model, peft, h, inter, {n: [f"a{i % n}" for i in range(b)] for n in ns}, r)
        for n, row in results.items():
            rows.append({"kind": kind, "tokens": f"{b}x{t}", "adapters": n, **row})
            print(f"  {kind:7s} {b}x{t:<4d} adapters={n:2d}  base {row['base_ms']:8.2f} ms  "
                  f"ours {row['ours_ms']:8.2f} ms (+{row['ours_overhead']:.1%})  "
                  f"peft {row['peft_ms']:8.2f} ms (+{row['peft_overhead']:.1%})", flush=True)  # fmt: skip
    return rows


def cold_vs_memcpy(pool: AdapterPool, d: Path, nbytes: int, reps: int) -> dict[str, float]:
    """Cold ``pool.load`` (then evict) vs libc memcpy of the same number of bytes, interleaved."""
    src, dst = torch.empty(nbytes // 4).normal_(), torch.zeros(nbytes // 4)

    def cold_load() -> None:
        pool.load("cold", d)
        pool.evict("cold")

    def memcpy() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)  # one thread, like the load

    ms, _ = side_by_side({"load": cold_load, "memcpy": memcpy}, reps)
    gbps = {k: nbytes / (v / 1e3) / 1e9 for k, v in ms.items()}
    return {"bytes": nbytes, "load_ms": ms["load"], "memcpy_ms": ms["memcpy"], "load_GBps": gbps["load"],
            "memcpy_GBps": gbps["memcpy"], "ratio": gbps["load"] / gbps["memcpy"]}  # fmt: skip


def bench_pool(root: Path, per_rank: int, reps: int) -> dict:
    model = Layer().eval()
    ranks = [8, 16, 32, 64] * per_rank
    dirs = [write_adapter(root / f"mix-{i}-r{r}", r, seed=100 + i) for i, r in enumerate(ranks)]
    per_rank_bytes = sum(d_in + d_out for d_in, d_out in SHAPES.values()) * 4
    total = sum(ranks) * per_rank_bytes
    pool = AdapterPool.for_model(model, budget_bytes=int(total * 1.02) + (1 << 20))
    for i, d in enumerate(dirs):
        pool.load(f"m{i}", d)
    st = pool.stats()
    slot_util = total / (len(ranks) * max(ranks) * per_rank_bytes)
    out = {"adapters": len(ranks), "ranks": sorted(set(ranks)), "page_elems": st["page_elems"],
           "utilization": st["utilization"], "slot_padding_utilization": slot_util}  # fmt: skip
    print(f"  utilization {st['utilization']:.4%} vs slot padding to rank {max(ranks)}: {slot_util:.2%}")

    # cold loads: page cache -> pool pages, vs memcpy of the same bytes. One layer's adapters
    # show the fixed per-load cost; a whole 32-layer 7B adapter (rank 16) shows the bandwidth.
    for name in pool.resident():
        pool.evict(name)
    full = write_adapter(root / "full-7b-r16", 16, seed=7, layers=32)
    specs = {n: ModuleSpec(i, *shape) for i, (n, shape) in enumerate(module_names(32).items())}
    full_pool = AdapterPool(specs, budget_bytes=16 * 32 * per_rank_bytes + (1 << 20))
    cases = [(f"1-layer r{r}", pool, next(d for d, k in zip(dirs, ranks, strict=True) if k == r), r * per_rank_bytes)
             for r in (16, 64)] + [("32-layer r16", full_pool, full, 32 * 16 * per_rank_bytes)]  # fmt: skip
    cold = {}
    for label, target, d, nbytes in cases:
        cold[label] = cold_vs_memcpy(target, d, nbytes, reps)
        c = cold[label]
        print(f"  cold load {label} ({nbytes / 2**20:.1f} MiB): {c['load_GBps']:.2f} GB/s vs memcpy "
              f"{c['memcpy_GBps']:.2f} GB/s = {c['ratio']:.0%}")  # fmt: skip
    out["cold_load"] = cold

    # warm re-activation: load() of a resident adapter
    pool.load("warm", dirs[1])
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        pool.load("warm", dirs[1])
    warm_us = (time.perf_counter() - t0) / n * 1e6
    out["warm_activation_us"] = warm_us
    print(f"  warm re-activation: {warm_us:.2f} us")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer reps, smaller prefill: under a minute")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, quick={args.quick}")
    with tempfile.TemporaryDirectory(prefix="acelora-bench-") as tmp:
        root = Path(tmp)
        if args.quick:
            fwd = bench_forward(root, [1, 32], batch=32, reps=3, prefill=(2, 128), prefill_reps=1)
            pool = bench_pool(root, per_rank=1, reps=10)
        else:
            fwd = bench_forward(root, [1, 8, 32], batch=32, reps=15, prefill=(8, 128), prefill_reps=5)
            pool = bench_pool(root, per_rank=2, reps=30)
    result = {"quick": args.quick, "threads": torch.get_num_threads(), "forward": fwd, "pool": pool}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

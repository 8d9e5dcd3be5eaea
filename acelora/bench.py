"""``acelora bench route``: p50/p99 of ``MultiLoRA.route()`` for growing registries (hits and fallbacks mixed)."""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence

from acelora.fleet import Fleet, ModelServer
from acelora.registry import AdapterRegistry, AdapterSpec
from acelora.skill import MultiLoRA, RouteRequest

BASE = "meta-llama/Llama-3.3-70B-Instruct"


def build_skill(n_adapters: int, n_tenants: int = 100, servers: int = 2) -> MultiLoRA:
    """A prod skill with ``n_adapters`` (ranks 8..64; every 10th private to one tenant) and a fleet."""
    rng = random.Random(n_adapters)
    specs = [
        AdapterSpec(name=f"tenant{i % n_tenants:03d}-task{i:06d}", path=f"/adapters/{i}", rank=rng.choice((8, 16, 32, 64)),
                    base_model=BASE, size_bytes=rng.randint(1, 64) << 20)
        for i in range(n_adapters)
    ]
    grants: dict[str, list[str]] = {}
    for i, s in enumerate(specs):
        if i % 10 == 0:
            grants.setdefault(f"t{i % n_tenants}", []).append(s.name)
    reg = AdapterRegistry(specs, grants=grants)
    fleet = Fleet(ModelServer(name=f"vllm-{k}", endpoint=f"http://gpu{k}:8000", kind="vllm", base_model=BASE,
                              max_lora_rank=32, capacity=64) for k in range(servers))
    for k, s in enumerate(fleet):
        s.resident.update(spec.name for spec in specs[k::7][:64])
    return MultiLoRA(registry=reg, fleet=fleet, mode="prod")


def requests_for(skill: MultiLoRA, n: int, seed: int = 0) -> list[RouteRequest]:
    """About 60% hits (resident or cold) and 40% fallbacks (unknown, forbidden, invalid, rank too large)."""
    rng = random.Random(seed)
    names = [s.name for s in skill.registry]
    out = []
    for _ in range(n):
        r = rng.random()
        name = rng.choice(names)
        if r < 0.70:
            out.append(RouteRequest(model=BASE, lora_name=name, tenant=f"t{rng.randrange(100)}"))
        elif r < 0.80:
            out.append(RouteRequest(model=f"missing-{rng.randrange(10**6)}", tenant="t1"))
        elif r < 0.90:
            out.append(RouteRequest(model=rng.choice(names[::10]), tenant="intruder"))  # another tenant's
        else:
            out.append(RouteRequest(model=BASE, lora_name="../" + name))
    return out


def measure(skill: MultiLoRA, reqs: list[RouteRequest], repeats: int = 5) -> dict[str, float]:
    """Per-call latency in µs (timer cost subtracted), over ``repeats`` passes of ``reqs``."""
    perf = time.perf_counter_ns
    route = skill.route
    for r in reqs[:2000]:
        route(r)  # warm caches
    empty = []
    for _ in range(20000):
        t0 = perf()
        empty.append(perf() - t0)
    timer = statistics.median(empty)
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            for r in reqs:
                t0 = perf()
                route(r)
                samples.append(perf() - t0 - timer)
    finally:
        gc.enable()
    samples.sort()
    q = lambda p: samples[min(len(samples) - 1, int(p * len(samples)))] / 1000  # noqa: E731
    actions: dict[str, int] = {}
    for r in reqs:
        d = route(r)
        key = d.action if d.fallback_reason is None else f"fallback:{d.fallback_reason}"
        actions[key] = actions.get(key, 0) + 1
    return {"p50_us": round(q(0.50), 3), "p99_us": round(q(0.99), 3), "mean_us": round(statistics.fmean(samples) / 1000, 3),
            "timer_ns": timer, "calls": len(samples), "mix": actions}


def bench_main(argv: Sequence[str] | None = None) -> int:
    """Run the route() benchmark; ``--json`` prints machine-readable results."""
    p = argparse.ArgumentParser(prog="acelora bench route", description=__doc__)
    p.add_argument("what", nargs="?", default="route", choices=["route"])
    p.add_argument("--sizes", default="10,1000,10000,100000")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(list(argv or []))
    results = {}
    for n in (int(x) for x in args.sizes.split(",")):
        skill = build_skill(n)
        results[n] = measure(skill, requests_for(skill, args.requests), args.repeats)
        if not args.json:
            r = results[n]
            print(f"{n:>7} adapters: p50 {r['p50_us']:.3f} µs  p99 {r['p99_us']:.3f} µs  mean {r['mean_us']:.3f} µs"
                  f"  ({r['calls']} calls, timer {r['timer_ns']} ns subtracted)", flush=True)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        print("mix per pass:", json.dumps(results[max(results)]["mix"]))
    return 0

"""Embedded engine throughput: one mixed-adapter batch vs serving the same requests adapter by adapter.

Both runs use the same engine (tiny Llama, demo adapters all resident beforehand, greedy, same
prompts), so they generate exactly the same tokens; only the batching differs:

- mixed: all requests (one distinct adapter each) are submitted at once and decode as one batch;
- one adapter at a time: for each adapter, its requests are submitted and run to the end before
  the next adapter's (the batch is one adapter's requests), as a single-adapter server would.

    python benchmarks/engine.py            # 32 sequences x 32 adapters, 3 rounds
    python benchmarks/engine.py --quick    # 1 round, shorter answers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from acelora_kernels.demo_adapters import demo_assets
from acelora_kernels.engine import Engine, SamplingParams
from acelora_kernels.pool import AdapterPool
from acelora_kernels.tiny import load_model_and_tokenizer

QUESTIONS = [
    "Write a Python function that returns the sum of a list.",
    "What should I do about a headache?",
    "Summarise clause 4.2 of the contract.",
    "How did revenue change last quarter?",
    "Write a slogan for our new product.",
    "hello",
    "Explain what a LoRA adapter is, briefly.",
    "List three risks of the plan.",
]


def run_round(
    engine: Engine, requests: list[tuple[list[int], str, SamplingParams]], mixed: bool
) -> tuple[float, list]:
    """Wall seconds and results of one pass over ``requests``."""
    t0 = time.perf_counter()
    if mixed:
        results = engine.generate_many(requests)
    else:
        results = []
        for name in dict.fromkeys(r[1] for r in requests):
            results += engine.generate_many([r for r in requests if r[1] == name])
    return time.perf_counter() - t0, results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of shorter answers")
    ap.add_argument("--adapters", type=int, default=32, help="distinct adapters (one sequence each)")
    ap.add_argument("--per-adapter", type=int, default=1, help="sequences per adapter")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument(
        "--cache-dir", default=None, help="demo adapter cache (default $ACELORA_CACHE or ~/.cache/acelora)"
    )
    ap.add_argument("--json", dest="json_out", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    max_tokens = args.max_tokens or (12 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 3)

    t0 = time.perf_counter()
    assets = demo_assets(max(60, args.adapters), cache_dir=args.cache_dir)
    print(f"demo assets ready in {time.perf_counter() - t0:.1f}s ({assets.root})", file=sys.stderr)
    names = list(assets.adapters)[: args.adapters]
    model, tok = load_model_and_tokenizer(assets.base_dir)
    pool = AdapterPool.for_model(model, 256 << 20)
    engine = Engine(
        model, tok, pool, {n: assets.adapters[n] for n in names}, max_batch=len(names) * args.per_adapter
    )
    for n in names:
        pool.load(n, assets.adapters[n])  # both runs start with every adapter resident
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    requests = [
        (
            engine.encode_chat(
                [{"role": "user", "content": QUESTIONS[(i * args.per_adapter + j) % len(QUESTIONS)]}]
            ),
            n,
            greedy,
        )
        for i, n in enumerate(names)
        for j in range(args.per_adapter)
    ]
    run_round(engine, requests[:4], mixed=True)  # warm-up
    timings: dict[str, list[float]] = {"mixed": [], "one_adapter_at_a_time": []}
    outputs = {}
    for _ in range(rounds):
        for mode in timings:  # alternate, so drift in machine load hits both
            wall, results = run_round(engine, requests, mixed=mode == "mixed")
            timings[mode].append(wall)
            outputs[mode] = [r.token_ids for r in results]
    engine.close()
    tokens = sum(len(t) for t in outputs["mixed"])
    same = outputs["mixed"] == outputs["one_adapter_at_a_time"]
    correct = sum(
        tok.decode(t).startswith(assets.markers[n])
        for t, (_, n, _) in zip(outputs["mixed"], requests, strict=True)
    )
    report = {
        "sequences": len(requests), "distinct_adapters": len(names), "max_tokens": max_tokens, "rounds": rounds,
        "generated_tokens": tokens, "identical_outputs": same, "outputs_with_own_marker": correct,
        "engine_threads": engine.threads or torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip
    for mode, walls in timings.items():
        med = statistics.median(walls)
        report[mode] = {"wall_s_median": round(med, 3), "walls_s": [round(w, 3) for w in walls],
                        "tokens_per_s": round(tokens / med, 1)}  # fmt: skip
    speedup = report["mixed"]["tokens_per_s"] / report["one_adapter_at_a_time"]["tokens_per_s"]
    report["speedup"] = round(speedup, 2)
    print(f"{len(requests)} sequences x {len(names)} adapters, {tokens} tokens, median of {rounds} round(s)")
    print(f"{'mode':<24}{'wall s':>10}{'tokens/s':>12}")
    for mode in timings:
        print(f"{mode:<24}{report[mode]['wall_s_median']:>10.3f}{report[mode]['tokens_per_s']:>12.1f}")
    print(f"speedup {speedup:.2f}x; identical outputs: {same}; own marker: {correct}/{len(requests)}; "
          f"1-min load average {report['loadavg_1m']:.2f} on {report['cpus']} CPUs")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

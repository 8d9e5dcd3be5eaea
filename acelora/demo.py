"""``acelora demo``: the whole product on one CPU, end to end, with a report.

1. the embedded engine (tiny Llama + trained demo adapters) behind vLLM's HTTP dialect, runtime loading on;
2. an acelora gateway in front of it (tenants, grants, prod mode, cold loads through vLLM's load API);
3. the real OpenAI SDK sending mixed-adapter traffic through the gateway (streaming and not), plus a
   ``wrap_openai`` client going straight to the engine, plus one native ``/v1/execute`` call;
4. a report: per-request decisions, whether each adapter's output shows its own marker, swap times,
   prefetch hits, latency, and the gateway's Prometheus counters. Written to ``runs/demo-report.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPTS = ["How do I sum a list?", "What should I do about a headache?", "Is this contract valid?",
           "How did the quarter go?", "Write a tagline for us."]


def _grants(names: list[str]) -> dict[str, list[str]]:
    """acme: code + fin (and their variants); globex: med + legal (and theirs); brand-voice stays public."""
    acme = [n for n in names if n.startswith(("code-python", "fin-analyst"))]
    globex = [n for n in names if n.startswith(("med-qa", "legal-compliance"))]
    return {"tenant_acme": acme, "tenant_globex": globex}


def _plan(names: list[str], grants: dict[str, list[str]], rounds: int, base: str) -> list[dict[str, Any]]:
    owner = {n: t for t, ns in grants.items() for n in ns}
    plan: list[dict[str, Any]] = []
    for r in range(rounds):
        for i, name in enumerate(names):
            tenant = owner.get(name, "tenant_acme" if i % 2 else "tenant_globex")
            plan.append({"tenant": tenant, "adapter": name, "via": "lora_name" if i % 2 else "model",
                         "stream": (i + r) % 3 == 0, "prompt": PROMPTS[(i + r) % len(PROMPTS)]})
        plan.append({"tenant": "tenant_acme", "adapter": None, "stream": False, "prompt": PROMPTS[r % 5]})
    plan += [
        {"tenant": "tenant_acme", "adapter": "med-qa-v1", "via": "lora_name", "note": "another tenant's adapter"},
        {"tenant": "tenant_acme", "adapter": "code-python-v9", "via": "lora_name", "note": "unknown adapter"},
        {"tenant": "tenant_acme", "adapter": "../../etc/passwd", "via": "lora_name", "note": "invalid name"},
        {"tenant": "tenant_acme", "adapter": "code-python-v2", "via": "model", "shadow": True, "note": "shadow override"},
    ]
    for p in plan:
        p.setdefault("stream", False)
        p.setdefault("prompt", PROMPTS[0])
        p["base"] = base
    return plan


def _send(client: Any, p: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"messages": [{"role": "user", "content": p["prompt"]}], "max_tokens": 32,
                              "temperature": 0, "model": p["base"]}
    headers = {"x-ace-tenant-id": p["tenant"]}
    if p.get("shadow"):
        headers["x-ace-skill-override"] = "multi_lora=shadow"
    if p["adapter"] is not None:
        if p.get("via") == "model":
            kwargs["model"] = p["adapter"]
        else:
            kwargs["extra_body"] = {"lora_name": p["adapter"]}
    t0 = time.perf_counter()
    if p["stream"]:
        raw = client.chat.completions.with_raw_response.create(stream=True, extra_headers=headers, **kwargs)
        text = "".join((c.choices[0].delta.content or "") for c in raw.parse() if c.choices)
        served_model = None
    else:
        raw = client.chat.completions.with_raw_response.create(extra_headers=headers, **kwargs)
        completion = raw.parse()
        text, served_model = completion.choices[0].message.content or "", completion.model
    ms = (time.perf_counter() - t0) * 1000
    return {**p, "text": text, "served_model": served_model, "ms": ms,
            "trace": raw.headers.get("x-ace-trace-multi-lora"), "served_by": raw.headers.get("x-ace-served-by")}


def _check(row: dict[str, Any], markers: dict[str, str]) -> bool | None:
    """Did the output come from the adapter the decision says it ran on?"""
    from acelora.trace import decode_header

    event = decode_header(row["trace"]) if row.get("trace") else None
    row["action"] = event.action if event else "base"
    row["fallback_reason"] = event.fallback_reason if event else None
    row["swap_ms"] = event.swap_ms if event else None
    applied = event is not None and event.action in ("adapter_prefetched_applied", "adapter_cold_loaded_applied")
    # shadow passes the request untouched: a model= that names a loaded adapter still runs on it upstream
    untouched_adapter = event is not None and event.mode == "shadow" and row.get("via") == "model"
    text = row["text"]
    if applied or untouched_adapter:
        return text.startswith(markers[row["adapter"]])
    return not any(text.startswith(m) for m in markers.values())  # base model: no adapter's marker


def run_demo(n_adapters: int = 12, rounds: int = 3, concurrency: int = 8, max_loras: int = 4,
             report_path: str | None = "runs/demo-report.json", out: Any = sys.stdout) -> dict[str, Any]:
    """Run the demo and return its report (see the module docstring)."""
    import httpx
    import openai

    from acelora import AdapterRegistry, Fleet, ModelServer, MultiLoRA, create_gateway, wrap_openai
    from acelora.serving import BackgroundServer
    from acelora_kernels.demo_adapters import demo_assets
    from acelora_kernels.engine import Engine
    from acelora_kernels.server import create_app
    from acelora_kernels.tiny import TINY_MODEL_NAME, load_model_and_tokenizer, weight_bytes

    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    say(f"[1/4] demo assets: tiny Llama + {n_adapters} PEFT adapters (trained on this CPU on first run, then cached)")
    assets = demo_assets(n_adapters)
    model, tokenizer = load_model_and_tokenizer(assets.base_dir)
    engine = Engine(model, tokenizer, max_loras=max_loras)
    engine_app = create_app(engine, TINY_MODEL_NAME, allow_runtime_lora=True, adapter_roots=[assets.adapters_dir],
                            max_loras=max_loras, base_weight_bytes=weight_bytes(model))
    names = list(assets.adapters)
    grants = _grants(names)
    registry = AdapterRegistry.from_dir(assets.adapters_dir, tenants=grants)
    with BackgroundServer(engine_app) as eng:
        server = ModelServer(name="embedded-engine", endpoint=eng.url, kind="vllm", base_model=TINY_MODEL_NAME,
                             max_lora_rank=64, capacity=len(names), base_model_bytes=weight_bytes(model))
        skill = MultiLoRA(registry=registry, fleet=Fleet([server]), mode="prod")
        say(f"[2/4] engine (vLLM dialect) at {eng.url}; gateway in front, {len(registry)} adapters, "
            f"tenants {', '.join(grants)}")
        with BackgroundServer(create_gateway(skill)) as gw:
            say(f"[3/4] mixed traffic through the gateway at {gw.url} ({concurrency} concurrent clients)")
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="demo", max_retries=0, timeout=120)
            plan = _plan(names, grants, rounds, TINY_MODEL_NAME)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                rows = list(pool.map(lambda p: _send(client, p), plan))
            wall_s = time.perf_counter() - t0
            direct = wrap_openai(openai.OpenAI(base_url=eng.url + "/v1", api_key="demo", max_retries=0, timeout=120),
                                 skill, tenant="tenant_globex")
            for name in ("med-qa-v1", "legal-compliance-v1", "code-python-v2"):
                row = _send(direct, {"tenant": "tenant_globex", "adapter": name, "via": "lora_name", "stream": False,
                                     "prompt": PROMPTS[1], "base": TINY_MODEL_NAME})
                rows.append({**row, "client": "wrap_openai"})
            execute = httpx.post(gw.url + "/v1/execute", headers={"x-ace-tenant-id": "tenant_acme"}, timeout=120, json={
                "input": {"messages": [{"role": "user", "content": "sum a list"}], "max_tokens": 32, "temperature": 0},
                "target": {"model": TINY_MODEL_NAME},
                "skill_overrides": {"multi_lora": {"mode": "prod"}},
                "extra_body": {"lora_name": "fin-analyst-v1"},
            }).json()
            metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    say("[4/4] report")
    report = _report(rows, assets.markers, wall_s, execute, metrics, skill)
    report["total_s"] = round(time.perf_counter() - t_start, 2)
    _print_report(report, say)
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=2, default=str))
        say(f"report written to {report_path}")
    return report


def _report(rows: list[dict[str, Any]], markers: dict[str, str], wall_s: float, execute: dict[str, Any],
            metrics: str, skill: Any) -> dict[str, Any]:
    for row in rows:
        row["output_ok"] = _check(row, markers)
    applied = [r for r in rows if r["action"] in ("adapter_prefetched_applied", "adapter_cold_loaded_applied")]
    cold = [r["swap_ms"] for r in applied if r["action"] == "adapter_cold_loaded_applied" and r["swap_ms"] is not None]
    lat = sorted(r["ms"] for r in rows)
    return {
        "requests": len(rows),
        "actions": dict(Counter(r["action"] for r in rows)),
        "fallback_reasons": dict(Counter(r["fallback_reason"] for r in rows if r["fallback_reason"])),
        "outputs_as_expected": sum(1 for r in rows if r["output_ok"]),
        "adapter_outputs_with_own_marker": f"{sum(1 for r in applied if r['output_ok'])}/{len(applied)}",
        "prefetch_hit_rate": round(sum(r["action"] == "adapter_prefetched_applied" for r in applied) / max(1, len(applied)), 3),
        "cold_swap_ms_p50": round(statistics.median(cold), 2) if cold else None,
        "latency_ms_p50": round(statistics.median(lat), 1),
        "latency_ms_p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1),
        "gateway_wall_s": round(wall_s, 2),
        "acelora_overhead_ms_p50": round(statistics.median(e.overhead_ms for e in skill.traces.all() if e.overhead_ms is not None), 4),
        "execute": {"output_text": execute.get("output", {}).get("choices", [{}])[0].get("message", {}).get("content"),
                    "trace": execute.get("trace")},
        "metrics": [line for line in metrics.splitlines() if line.startswith("acelora_multi_lora_requests_total")],
        "rows": [{k: r.get(k) for k in ("client", "tenant", "adapter", "stream", "action", "fallback_reason", "swap_ms",
                                        "served_by", "ms", "text", "output_ok")} for r in rows],
    }


def _print_report(rep: dict[str, Any], say: Any) -> None:
    say(f"{'tenant':14} {'requested':24} {'action':29} {'reason':16} {'swap_ms':>8} {'ms':>7}  output")
    for r in rep["rows"]:
        swap = f"{r['swap_ms']:.1f}" if r["swap_ms"] is not None else "-"
        ok = "ok " if r["output_ok"] else "BAD"
        say(f"{r['tenant']:14} {str(r['adapter'])[:24]:24} {r['action']:29} {r['fallback_reason'] or '-':16} "
            f"{swap:>8} {r['ms']:7.0f}  {ok} {r['text'][:34]!r}{' (stream)' if r['stream'] else ''}"
            f"{' (wrap_openai)' if r['client'] else ''}")
    say("")
    for key in ("requests", "actions", "fallback_reasons", "adapter_outputs_with_own_marker", "outputs_as_expected",
                "prefetch_hit_rate", "cold_swap_ms_p50", "latency_ms_p50", "latency_ms_p99", "gateway_wall_s",
                "acelora_overhead_ms_p50"):
        say(f"  {key:34} {rep[key]}")
    say(f"  {'/v1/execute output':34} {rep['execute']['output_text']!r}")
    say(f"  {'/v1/execute trace':34} {json.dumps(rep['execute']['trace'])[:200]}")
    for line in rep["metrics"]:
        say(f"  {line}")


def demo_main(argv: Sequence[str] | None = None) -> int:
    """``acelora demo [--adapters N] [--rounds R] [--concurrency C] [--report PATH]``."""
    p = argparse.ArgumentParser(prog="acelora demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=12, help="demo adapters to make and serve (>= 5)")
    p.add_argument("--rounds", type=int, default=3, help="passes over every adapter (the first one loads cold)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=4, help="adapters the engine runs in one batch")
    p.add_argument("--report", default="runs/demo-report.json")
    args = p.parse_args(list(argv or []))
    if args.adapters < 5:
        p.error("--adapters must be at least 5 (the five seed domains)")
    rep = run_demo(args.adapters, args.rounds, args.concurrency, args.max_loras, args.report)
    return 0 if rep["outputs_as_expected"] == rep["requests"] else 1

"""Front-end overhead: what MultiLoRAMiddleware adds to an ASGI app, and what the gateway hop adds.

1. Middleware: the same Starlette app called in-process through ASGI, with and without the middleware,
   interleaved call by call (A, B, A, B, ...) so both see the same machine state; p50/p99 of each.
2. Gateway: an OpenAI-style upstream (uvicorn, its own process) called directly and through
   ``acelora gateway`` (uvicorn, its own process) on loopback, interleaved, keep-alive httpx client.

    python benchmarks/frontends.py            # full run
    python benchmarks/frontends.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
BASE = "tiny-llama"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(ns: list[int]) -> dict[str, float]:
    us = [v / 1000 for v in ns]
    return {"p50_us": round(pct(us, 0.5), 2), "p99_us": round(pct(us, 0.99), 2), "mean_us": round(statistics.mean(us), 2)}


# -- upstream ------------------------------------------------------------------------------------
def upstream_app() -> Any:
    """A tiny OpenAI-style chat endpoint: reads the body, echoes the model."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body.get("model"),
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        return Response(json.dumps(out), media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(json.dumps({"object": "list", "data": [{"id": BASE, "object": "model", "parent": None},
                                                               {"id": "code-python-v2", "object": "model",
                                                                "parent": BASE}]}), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])


def make_skill(mode: str, endpoint: str = "http://127.0.0.1:9") -> Any:
    from acelora.fleet import Fleet, ModelServer
    from acelora.registry import AdapterRegistry, AdapterSpec
    from acelora.skill import MultiLoRA

    registry = AdapterRegistry([AdapterSpec(name=f"adapter-{i}", path=f"/a/{i}", base_model=BASE, size_bytes=2**21)
                                for i in range(200)] + [AdapterSpec(name="code-python-v2", path="/a/c", base_model=BASE)])
    server = ModelServer(name="up", endpoint=endpoint, kind="vllm", base_model=BASE, base_model_bytes=2**30,
                         resident={"code-python-v2"})
    return MultiLoRA(registry=registry, fleet=Fleet([server]), mode=mode)


# -- 1. middleware, in-process ASGI --------------------------------------------------------------
async def asgi_call(app: Any, scope: dict[str, Any], body: bytes) -> None:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The least an ASGI app can do: take the body, answer 200 (to see the middleware's own cost)."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def bench_middleware(mode: str, n: int, warmup: int, bare: bool = False) -> dict[str, Any]:
    from starlette.middleware import Middleware

    from acelora.middleware import MultiLoRAMiddleware

    if bare:
        plain: Any = bare_app
        wrapped: Any = MultiLoRAMiddleware(bare_app, skill=make_skill(mode))
    else:
        plain = upstream_app()
        wrapped = upstream_app()
        wrapped.user_middleware = [Middleware(MultiLoRAMiddleware, skill=make_skill(mode))]
    body = json.dumps({"model": BASE, "messages": MESSAGES, "lora_name": "code-python-v2", "max_tokens": 64}).encode()
    headers = [(b"host", b"bench"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"x-ace-tenant-id", b"tenant_dev_01")]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("bench", 80)}
    a: list[int] = []
    b: list[int] = []
    clock = time.perf_counter_ns
    for i in range(warmup + n):
        for app, out in ((plain, a), (wrapped, b)) if i % 2 else ((wrapped, b), (plain, a)):
            t = clock()
            await asgi_call(app, dict(scope), body)
            if i >= warmup:
                out.append(clock() - t)
    added = [y - x for x, y in zip(a, b, strict=True)]
    return {"mode": mode + (" (bare app)" if bare else ""), "without": summary(a), "with": summary(b),
            "added_p50_us": round(pct(b, 0.5) / 1000 - pct(a, 0.5) / 1000, 2),
            "added_pairwise_p50_us": round(pct(added, 0.5) / 1000, 2)}


# -- 2. gateway hop over loopback ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(kind: str, port: int, upstream: str | None) -> None:
    import logging

    import uvicorn

    logging.getLogger("acelora").setLevel(logging.ERROR)
    if kind == "upstream":
        app = upstream_app()
    else:
        from acelora.gateway import create_gateway

        app = create_gateway(make_skill("prod", upstream or ""), timeout_s=30)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def wait_up(url: str, deadline_s: float = 30) -> None:
    import httpx

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {deadline_s} s")


def bench_gateway(n: int, warmup: int) -> dict[str, Any]:
    import httpx

    up_port, gw_port = free_port(), free_port()
    up_url, gw_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    me = os.path.abspath(__file__)
    procs = [subprocess.Popen([sys.executable, me, "--serve", "upstream", "--port", str(up_port)]),
             subprocess.Popen([sys.executable, me, "--serve", "gateway", "--port", str(gw_port), "--upstream", up_url])]
    try:
        wait_up(f"{up_url}/v1/models")
        wait_up(f"{gw_url}/healthz")
        direct: list[int] = []
        via: list[int] = []
        body = {"model": "code-python-v2", "messages": MESSAGES, "max_tokens": 64}
        with httpx.Client(timeout=10) as c:
            for i in range(warmup + n):
                for url, out in ((up_url, direct), (gw_url, via)) if i % 2 else ((gw_url, via), (up_url, direct)):
                    t = time.perf_counter_ns()
                    r = c.post(f"{url}/v1/chat/completions", json=body)
                    dt = time.perf_counter_ns() - t
                    if r.status_code != 200 or r.json()["model"] != "code-python-v2":
                        raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
                    if i >= warmup:
                        out.append(dt)
        return {"direct": summary(direct), "via_gateway": summary(via),
                "added_p50_us": round(pct(via, 0.5) / 1000 - pct(direct, 0.5) / 1000, 1)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (a few seconds)")
    p.add_argument("-n", type=int, default=None, help="measured calls per variant")
    p.add_argument("--skip-gateway", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--serve", choices=["upstream", "gateway"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.upstream)
        return 0
    n_mw = args.n or (3000 if args.quick else 30000)
    n_gw = args.n or (300 if args.quick else 3000)
    results: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "middleware": []}
    for mode in ("prod", "shadow", "off"):
        results["middleware"].append(asyncio.run(bench_middleware(mode, n_mw, warmup=n_mw // 10)))
    results["middleware"].append(asyncio.run(bench_middleware("prod", n_mw, warmup=n_mw // 10, bare=True)))
    if not args.skip_gateway:
        results["gateway"] = bench_gateway(n_gw, warmup=n_gw // 10)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"python {results['python']}, {results['cpus']} CPUs; middleware n={n_mw} per variant, interleaved")
    print(f"{'mode':17s} {'without p50/p99 us':>20s} {'with p50/p99 us':>18s} {'added p50 us':>13s}")
    for r in results["middleware"]:
        w, m = r["without"], r["with"]
        print(f"{r['mode']:17s} {w['p50_us']:>9.1f}/{w['p99_us']:<9.1f} {m['p50_us']:>8.1f}/{m['p99_us']:<8.1f} "
              f"{r['added_p50_us']:>10.1f}")
    if "gateway" in results:
        g = results["gateway"]
        print(f"gateway hop (n={n_gw}): direct p50/p99 {g['direct']['p50_us']:.0f}/{g['direct']['p99_us']:.0f} us, "
              f"via gateway {g['via_gateway']['p50_us']:.0f}/{g['via_gateway']['p99_us']:.0f} us, "
              f"added p50 {g['added_p50_us']:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The gateway before the first byte: a forgotten adapter is loaded again, a refusing server is failed over."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from upstream import ServerThread

from acelora.fleet import ModelServer
from acelora.gateway import create_gateway
from acelora.skill import RouteRequest
from acelora.trace import decode_header

MESSAGES = [{"role": "user", "content": "hi"}]


def trace_of(r) -> object:
    return decode_header(r.headers["x-ace-trace-multi-lora"])


def chat(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **body}, headers=headers or {},
                      timeout=10)


def refused_url() -> str:
    """A loopback port nobody listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# -- 3. stale residency --------------------------------------------------------------------------
def test_adapter_the_upstream_forgot_is_loaded_again_and_the_request_resent(make_skill, gateway, upstream):
    skill = make_skill("prod")
    url = gateway(skill)
    assert chat(url, {"model": "code-python-v2"}).json()["model"] == "code-python-v2"
    upstream.adapters.clear()  # the upstream restarted: nothing is loaded any more
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="code-python-v2", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == "[code-python-v2] hello"
    t = trace_of(raw.http_response)
    assert (t.action, t.adapter_name, t.served_by) == ("adapter_cold_loaded_applied", "code-python-v2", "vllm-primary")
    assert t.swap_ms is not None
    assert [b["lora_name"] for b in upstream.loads] == ["code-python-v2", "code-python-v2"]
    assert "code-python-v2" in skill.fleet.get("vllm-primary").resident
    assert trace_of(chat(url, {"model": "code-python-v2"})).action == "adapter_prefetched_applied"
    assert skill.traces.last().action == "adapter_prefetched_applied"


def test_forgotten_adapter_that_cannot_be_loaded_again_falls_back_to_the_base(make_skill, gateway, upstream):
    skill = make_skill("prod")
    url = gateway(skill)
    chat(url, {"model": "code-python-v2"})
    upstream.adapters.clear()
    upstream.fail_loads.add("code-python-v2")
    r = chat(url, {"model": "code-python-v2"})
    assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
    assert (trace_of(r).action, trace_of(r).fallback_reason) == ("fallback_base_model", "load_failed")
    assert "code-python-v2" not in skill.fleet.get("vllm-primary").resident
    assert [b["model"] for b in upstream.received] == ["code-python-v2", "code-python-v2", "tiny-llama"]


def test_forgotten_adapter_on_the_default_upstream_and_through_execute(make_skill, gateway, upstream):
    skill = make_skill("prod", fleet=False)
    url = gateway(skill, upstream=upstream.url)
    body = {"model": "tiny-llama", "lora_name": "code-python-v2"}
    assert chat(url, body).json()["model"] == "code-python-v2"
    upstream.adapters.clear()
    r = chat(url, body)
    assert r.json()["model"] == "code-python-v2" and trace_of(r).action == "adapter_cold_loaded_applied"
    upstream.adapters.clear()
    r = httpx.post(f"{url}/v1/execute", timeout=10,
                   json={"input": {"messages": MESSAGES}, "target": {"model": "code-python-v2"}})
    assert r.status_code == 200 and r.json()["output"]["model"] == "code-python-v2"
    assert r.json()["trace"][0]["action"] == "adapter_cold_loaded_applied"
    assert len(upstream.loads) == 3


def test_shadow_mode_never_reloads_on_a_404(make_skill, gateway, upstream):
    skill = make_skill("shadow")
    skill.fleet.get("vllm-primary").resident.add("code-python-v2")  # believed resident, the upstream disagrees
    r = chat(gateway(skill), {"model": "code-python-v2"})
    assert r.status_code == 404 and upstream.loads == [] and len(upstream.received) == 1


# -- 4. failover ---------------------------------------------------------------------------------
def add_dead(skill, *names: str) -> None:
    for name in names:
        skill.fleet.add(ModelServer(name=name, endpoint=refused_url(), kind="vllm", base_model="tiny-llama",
                                    max_lora_rank=16))


def test_servers_refusing_connections_are_cooled_down_and_requests_fail_over(make_skill, gateway, upstream):
    skill = make_skill("prod")
    add_dead(skill, "dead-0", "dead-1")
    url = gateway(skill)
    statuses = [chat(url, {"model": "tiny-llama"}, {"x-ace-tenant-id": f"t{i}"}).status_code for i in range(12)]
    assert statuses == [200] * 12
    assert {s.name: s.healthy for s in skill.fleet} == {"dead-0": False, "dead-1": False, "vllm-primary": True}
    r = chat(url, {"model": "code-python-v2"})
    assert r.json()["model"] == "code-python-v2" and r.headers["x-ace-served-by"] == "vllm-primary"


def test_adapter_request_fails_over_and_loads_on_the_next_server(make_skill, upstream):
    skill = make_skill("prod")
    add_dead(skill, *(f"dead-{i}" for i in range(4)))
    # the adapter's rendezvous order must put a dead server first for this test to mean anything
    first = skill.route(RouteRequest(model="code-python-v2")).server
    assert first.name.startswith("dead-"), "pick another adapter name: this one prefers the live server"
    with ServerThread(create_gateway(skill)) as srv:
        r = chat(srv.url, {"model": "code-python-v2"})
    assert r.status_code == 200 and r.json()["model"] == "code-python-v2"
    t = trace_of(r)
    assert (t.action, t.served_by) == ("adapter_cold_loaded_applied", "vllm-primary")
    assert r.headers["x-ace-served-by"] == "vllm-primary"
    assert not skill.fleet.get(first.name).healthy


def test_only_when_every_server_refuses_is_it_a_502_and_the_server_comes_back(make_skill, upstream):
    skill = make_skill("prod", fleet=False)
    add_dead(skill, "dead-0")
    app = create_gateway(skill)
    app.state.gateway.health.cooldown_s = 0.2
    with ServerThread(app) as srv:
        r = chat(srv.url, {"model": "tiny-llama"})
        assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
        dead = skill.fleet.get("dead-0")
        assert dead.healthy is False and "dead-0" in app.state.gateway.health.down_until
        deadline = time.monotonic() + 10
        while not dead.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead.healthy and app.state.gateway.health.down_until == {}
        r = httpx.post(f"{srv.url}/v1/execute", json={"input": {"messages": MESSAGES}}, timeout=10)
        assert r.status_code == 502 and not dead.healthy


@pytest.mark.parametrize("mode", ["off", "shadow"])
def test_untouched_requests_fail_over_too(make_skill, gateway, upstream, mode):
    skill = make_skill(mode)
    add_dead(skill, "dead-0", "dead-1")
    url = gateway(skill)
    for i in range(6):
        r = chat(url, {"model": "tiny-llama", "lora_name": "code-python-v2"}, {"x-ace-tenant-id": f"t{i}"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
    assert all(b.get("lora_name") == "code-python-v2" for b in upstream.received)


def test_an_upstream_that_drips_forever_is_cut_at_max_stream_s(make_skill, gateway):
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def drip(request):
        async def events():
            while True:  # one event every 0.1 s, never done: each read is fast, the whole is endless
                yield b'data: {"choices": []}\n\n'
                await asyncio.sleep(0.1)
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", drip, methods=["POST"])])
    with ServerThread(app) as srv:
        url = gateway(make_skill("off", fleet=False), upstream=srv.url, timeout_s=5, max_stream_s=0.6)
        t0 = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=10,
                          json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert time.monotonic() - t0 < 5
    assert lines[0].startswith("data: {") and "GatewayTimeoutError" in lines[-1]

"""MultiLoRAMiddleware inside Starlette and FastAPI apps: body rewrite, trace headers, passthrough, limits."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from upstream import BASE, ServerThread, UpstreamState, create_upstream, make_registry

from acelora.middleware import DECISION_KEY, SERVED_BY_KEY, MultiLoRAMiddleware
from acelora.skill import MultiLoRA
from acelora.trace import decode_header

MESSAGES = [{"role": "user", "content": "hi"}]


def echo_app(skill, **mw_options) -> Starlette:
    """Answers with what it received: raw body, headers, and the decision it found in the scope."""

    async def echo(request: Request) -> JSONResponse:
        raw = await request.body()
        decision = request.scope.get(DECISION_KEY)
        state = getattr(request.state, "acelora", None)
        if request.query_params.get("served_by"):
            request.scope[SERVED_BY_KEY] = request.query_params["served_by"]
        return JSONResponse({"raw": raw.decode("latin-1"), "headers": dict(request.headers),
                             "action": decision.action if decision else None,
                             "same_in_state": state is decision})

    async def stream(request: Request) -> StreamingResponse:
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/chat/completions", echo, methods=["POST"]), Route("/other", echo, methods=["POST", "GET"]),
              Route("/v1/completions", stream, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(MultiLoRAMiddleware, skill=skill, **mw_options)])


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


async def test_prod_rewrites_the_body_and_the_app_reads_the_decision(make_skill):
    skill = make_skill("prod", fleet=False)
    async with client_for(echo_app(skill)) as c:
        r = await c.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES,
                                                        "extra_body": {"lora_name": "code-python-v2", "seed": 1}})
    out = r.json()
    sent = json.loads(out["raw"])
    assert sent == {"model": "code-python-v2", "messages": MESSAGES, "seed": 1}
    assert out["headers"]["content-length"] == str(len(out["raw"].encode("latin-1")))
    assert out["action"] == "adapter_cold_loaded_applied" and out["same_in_state"] is True
    t = decode_header(r.headers["x-ace-trace-multi-lora"])
    assert (t.mode, t.adapter_name, t.overhead_ms is not None) == ("prod", "code-python-v2", True)
    assert skill.traces.last().adapter_name == "code-python-v2"


@pytest.mark.parametrize("mode", ["off", "shadow"])
async def test_off_and_shadow_pass_the_body_through_byte_for_byte(make_skill, mode):
    raw = b'{ "model" : "tiny-llama",\n "messages": [], "lora_name": "code-python-v2" }'
    async with client_for(echo_app(make_skill(mode, fleet=False))) as c:
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.json()["raw"].encode("latin-1") == raw
    assert ("x-ace-trace-multi-lora" in r.headers) is (mode == "shadow")


async def test_override_header_switches_mode_per_request(make_skill):
    async with client_for(echo_app(make_skill("off", fleet=False))) as c:
        r = await c.post("/v1/chat/completions", json={"model": "code-python-v2", "messages": []},
                         headers={"x-ace-skill-override": "multi_lora=shadow"})
    assert decode_header(r.headers["x-ace-trace-multi-lora"]).action == "would_load_lora"


async def test_forged_inbound_trace_headers_never_reach_the_app(make_skill):
    forged = {"x-ace-trace-multi-lora": "mode=prod,action=adapter_prefetched_applied", "x-ace-trace-other": "1",
              "x-keep": "yes"}
    async with client_for(echo_app(make_skill("prod", fleet=False))) as c:
        for path in ("/v1/chat/completions", "/other"):
            r = await c.post(path, json={"model": "tiny-llama", "messages": []}, headers=forged)
            seen = r.json()["headers"]
            assert not any(k.startswith("x-ace-trace") for k in seen) and seen["x-keep"] == "yes"


async def test_other_paths_and_methods_pass_through_unchanged(make_skill):
    skill = make_skill("prod", fleet=False)
    async with client_for(echo_app(skill)) as c:
        r = await c.post("/other", json={"model": "code-python-v2"})
        assert json.loads(r.json()["raw"]) == {"model": "code-python-v2"} and r.json()["action"] is None
        assert (await c.get("/other")).json()["action"] is None
        r = await c.post("/other", content=b"{oops")
        assert r.json()["raw"] == "{oops" and r.json()["action"] is None
    assert len(skill.traces) == 0


@pytest.mark.parametrize(("content", "message"), [
    (b"{oops", "Request body is not valid JSON."),
    (b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}", "Request body is not valid JSON."),  # deeper than any parser
    (b"[1]", "Request body must be a JSON object."),
    (b'"text"', "Request body must be a JSON object."),
])
async def test_unparsable_or_non_object_bodies_on_routed_paths_are_a_400_envelope(make_skill, content, message):
    skill = make_skill("prod", fleet=False)
    async with client_for(echo_app(skill)) as c:
        r = await c.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": message, "type": "BadRequestError", "param": None, "code": 400}
    assert len(skill.traces) == 0


async def test_json_is_routed_whatever_the_content_type_claims(make_skill):
    async with client_for(echo_app(make_skill("prod", fleet=False))) as c:
        r = await c.post("/v1/chat/completions", content=b'{"model": "code-python-v2", "messages": []}',
                         headers={"content-type": "text/plain"})
    assert json.loads(r.json()["raw"])["model"] == "code-python-v2" and r.json()["action"] is not None


async def test_body_over_the_limit_is_a_413_even_without_content_length(make_skill):
    async def chunks():
        for _ in range(8):
            yield b"x" * 1024

    async with client_for(echo_app(make_skill("prod", fleet=False), max_body_bytes=4096)) as c:
        r = await c.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        r = await c.post("/v1/chat/completions", content=b"{" + b" " * 5000 + b"}")
        assert r.status_code == 413


async def test_body_in_many_chunks_is_reassembled(make_skill):
    body = json.dumps({"model": "code-python-v2", "messages": [{"role": "user", "content": "y" * 3000}]}).encode()

    async def chunks():
        for i in range(0, len(body), 500):
            yield body[i:i + 500]

    async with client_for(echo_app(make_skill("prod", fleet=False))) as c:
        r = await c.post("/v1/chat/completions", content=chunks())
    assert json.loads(r.json()["raw"])["messages"][0]["content"] == "y" * 3000


async def test_bad_override_is_400_and_reject_is_404(make_skill):
    async with client_for(echo_app(make_skill("prod", fleet=False, on_unknown="reject"))) as c:
        r = await c.post("/v1/chat/completions", json={"model": "x"}, headers={"x-ace-skill-override": "multi_lora=x"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = await c.post("/v1/chat/completions", json={"model": "tiny-llama", "lora_name": "nope-v1"})
        assert r.status_code == 404 and r.json()["error"]["message"] == "The model `nope-v1` does not exist."
        assert decode_header(r.headers["x-ace-trace-multi-lora"]).action == "rejected"


async def test_app_can_name_who_served_the_request(make_skill):
    async with client_for(echo_app(make_skill("prod", fleet=False))) as c:
        r = await c.post("/v1/chat/completions?served_by=replica-7", json={"model": "code-python-v2"})
    assert r.headers["x-ace-served-by"] == "replica-7"
    assert decode_header(r.headers["x-ace-trace-multi-lora"]).served_by == "replica-7"


async def test_streamed_response_arrives_untouched_in_chunks(make_skill):
    async with client_for(echo_app(make_skill("prod", fleet=False))) as c:
        async with c.stream("POST", "/v1/completions", json={"model": "code-python-v2", "prompt": "x"}) as r:
            assert "x-ace-trace-multi-lora" in r.headers
            body = b"".join([chunk async for chunk in r.aiter_raw()])
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_loads_the_adapter_on_its_fleet_server_before_the_app_runs(make_skill, upstream):
    skill = make_skill("prod")
    app = echo_app(skill)
    mw = MultiLoRAMiddleware(app.router, skill=skill)  # wrapped by hand so the test can close its load client
    async with client_for(mw) as c:
        r = await c.post("/v1/chat/completions", json={"model": "code-python-v2"})
        assert r.json()["action"] == "adapter_cold_loaded_applied" and upstream.loads
        r = await c.post("/v1/chat/completions", json={"model": "broken-v1"})
        t = decode_header(r.headers["x-ace-trace-multi-lora"])
        assert (t.action, t.fallback_reason) == ("fallback_base_model", "load_failed")
        assert json.loads(r.json()["raw"])["model"] == "tiny-llama"
    await mw.aclose()


def test_inside_fastapi_with_the_sdk_over_uvicorn_streaming_and_raw_headers(make_skill):
    """A vLLM-like FastAPI service with acelora inside: the SDK talks to it directly."""
    state = UpstreamState(adapters={"code-python-v2"})
    api = FastAPI()
    api.add_middleware(MultiLoRAMiddleware, skill=make_skill("prod", fleet=False), served_by="svc-1")

    @api.get("/decision-free")
    async def free(request: FastAPIRequest) -> dict:
        return {"has": hasattr(request.state, "acelora")}

    api.mount("/", create_upstream(state))
    with ServerThread(api) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=MESSAGES, extra_body={"lora_name": "code-python-v2"})
        assert raw.parse().model == "code-python-v2" and raw.headers["x-ace-served-by"] == "svc-1"
        stream = client.chat.completions.create(model="code-python-v2", messages=MESSAGES, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "[code-python-v2] hello"
        assert httpx.get(f"{srv.url}/decision-free").json() == {"has": False}
    assert state.received[0] == {"model": "code-python-v2", "messages": MESSAGES}


async def test_without_a_loader_the_app_behind_loads_once_and_no_swap_is_invented():
    skill = MultiLoRA(registry=make_registry(), mode="prod", base_model=BASE)  # no fleet, nothing to load with
    async with client_for(echo_app(skill)) as c:
        traces = []
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json={"model": "code-python-v2", "messages": MESSAGES})
            traces.append(decode_header(r.headers["x-ace-trace-multi-lora"]))
    assert [t.action for t in traces] == ["adapter_cold_loaded_applied", "adapter_prefetched_applied"]
    assert traces[0].swap_ms is None and traces[0].swap_ms_saved is None  # not measured, so not reported

"""Gateway security: tenants cannot downgrade the mode, the fleet is closed without an admin key, upstream
traces are never relayed, and no body or bug produces anything but OpenAI's error envelope."""

from __future__ import annotations

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from upstream import ServerThread

from acelora.fleet import ModelServer
from acelora.trace import decode_header

MESSAGES = [{"role": "user", "content": "hi"}]
KEYS = {"sk-med": "tenant_med", "sk-other": "tenant_other"}
ADMIN = "sk-admin"
DEEP = b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"  # ~100 KB, under the body cap, deeper than any parser


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture()
def keyed(make_skill, gateway, upstream):
    upstream.adapters.add("med-qa-v1")  # loaded for tenant_med: untouched, the upstream would serve it to anyone
    return gateway(make_skill("prod", api_keys=KEYS, admin_key=ADMIN))


# -- 1. a tenant key cannot turn routing off -----------------------------------------------------
@pytest.mark.parametrize("mode", ["off", "shadow", "OFF"])
def test_tenant_key_cannot_override_the_mode_to_reach_another_tenants_adapter(keyed, upstream, mode):
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-other", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as err:
        client.chat.completions.create(model="med-qa-v1", messages=MESSAGES,
                                       extra_headers={"x-ace-skill-override": f"multi_lora={mode}"})
    assert "admin key" in err.value.body["message"] and err.value.body["type"] == "PermissionDeniedError"
    r = httpx.post(f"{keyed}/v1/execute", headers=bearer("sk-other"), timeout=10,
                   json={"input": {"messages": MESSAGES}, "target": {"model": "med-qa-v1"},
                         "skill_overrides": {"multi_lora": {"mode": mode.lower()}}})
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    assert "admin key" in r.json()["error"]["message"]
    assert upstream.received == []


def test_tenant_key_may_still_ask_for_prod_and_the_admin_may_downgrade(keyed, upstream):
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-other", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="med-qa-v1", messages=MESSAGES, extra_headers={"x-ace-skill-override": "multi_lora=prod"})
    assert raw.parse().model == "tiny-llama"  # another tenant's adapter: the base model, as if unknown
    assert decode_header(raw.headers["x-ace-trace-multi-lora"]).fallback_reason == "unknown_adapter"
    admin = openai.OpenAI(base_url=f"{keyed}/v1", api_key=ADMIN, max_retries=0)
    out = admin.chat.completions.create(model="med-qa-v1", messages=MESSAGES, extra_body={"lora_name": "x"},
                                        extra_headers={"x-ace-skill-override": "multi_lora=off"})
    assert out.model == "med-qa-v1" and upstream.received[-1]["lora_name"] == "x"  # untouched


def test_open_gateway_still_honours_mode_overrides(make_skill, gateway, upstream):
    url = gateway(make_skill("prod"))
    r = httpx.post(f"{url}/v1/chat/completions", headers={"x-ace-skill-override": "multi_lora=off"}, timeout=10,
                   json={"model": "tiny-llama", "messages": MESSAGES, "lora_name": "code-python-v2"})
    assert r.status_code == 200 and upstream.received[-1]["lora_name"] == "code-python-v2"
    r = httpx.post(f"{url}/v1/execute", timeout=10, json={"input": {"messages": MESSAGES},
                   "target": {"model": "tiny-llama"}, "skill_overrides": {"multi_lora": {"mode": "shadow"}}})
    assert r.status_code == 200 and r.json()["trace"] == []  # a base request in shadow: nothing to trace


# -- 2. the fleet is closed without an admin key; no env secret can be sent anywhere -------------
def test_open_gateway_does_not_open_the_fleet_admin_routes(make_skill, gateway, upstream):
    skill = make_skill("prod")
    url = gateway(skill)
    for r in (httpx.get(f"{url}/v1/fleet"),
              httpx.post(f"{url}/v1/fleet/servers", json={"name": "x", "endpoint": upstream.url}),
              httpx.delete(f"{url}/v1/fleet/servers/vllm-primary")):
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
        assert "admin key" in r.json()["error"]["message"]
    assert [s.name for s in skill.fleet] == ["vllm-primary"]


@pytest.mark.parametrize("env", ["ACELORA_UPSTREAM_KEY", "AWS_SECRET_ACCESS_KEY"])
def test_server_registration_refuses_api_key_env(make_skill, gateway, upstream, monkeypatch, env):
    monkeypatch.setenv(env, "sk-real-secret")
    skill = make_skill("prod", fleet=False, admin_key=ADMIN)
    url = gateway(skill)
    r = httpx.post(f"{url}/v1/fleet/servers", headers=bearer(ADMIN), timeout=10,
                   json={"name": "x", "endpoint": upstream.url, "api_key_env": env})
    assert r.status_code == 400 and r.json()["error"]["param"] == "api_key_env"
    assert "api_key_env" in r.json()["error"]["message"] and "sk-real" not in r.text
    assert len(skill.fleet) == 0


# -- 6. only acelora writes traces ---------------------------------------------------------------
FORGED = {"x-ace-trace-multi-lora": "mode=prod,action=adapter_prefetched_applied,adapter=evil-v1",
          "x-ace-served-by": "evil", "x-ace-trace-other": "forged", "x-upstream": "kept"}


@pytest.fixture()
def forging_upstream():
    async def chat(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            async def events():
                yield b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[]}\n\n'
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream", headers=FORGED)
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "finish_reason": "stop"}]}, headers=FORGED)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny-llama", "object": "model", "parent": None}]})

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])
    with ServerThread(app) as srv:
        yield srv.url


@pytest.mark.parametrize("mode", ["off", "shadow", "prod"])
@pytest.mark.parametrize("stream", [False, True])
def test_traces_sent_by_the_upstream_never_reach_the_client(make_skill, gateway, forging_upstream, mode, stream):
    url = gateway(make_skill(mode, fleet=False), upstream=forging_upstream)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                   json={"model": "tiny-llama", "messages": MESSAGES, "stream": stream})
    assert r.status_code == 200 and r.headers["x-upstream"] == "kept"
    assert "x-ace-trace-other" not in r.headers and "x-ace-served-by" not in r.headers
    assert "x-ace-trace-multi-lora" not in r.headers  # a base request: acelora has nothing to say about it


# -- 7. bodies no parser can take, and bugs, are answered in OpenAI's envelope --------------------
@pytest.mark.parametrize("mode", ["off", "prod"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/execute", "/v1/fleet/servers"])
@pytest.mark.parametrize("content", [DEEP, b"[1, 2]", b"\xff\xfe"])
def test_unparsable_bodies_are_a_400_envelope_on_every_post_route(make_skill, gateway, upstream, mode, path, content):
    url = gateway(make_skill(mode, admin_key=ADMIN))
    r = httpx.post(f"{url}{path}", content=content, timeout=10,
                   headers={"content-type": "application/json", **bearer(ADMIN)})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "BadRequestError"
    assert upstream.received == []


def test_an_unexpected_error_is_a_500_envelope_without_traceback(make_skill, gateway, caplog):
    skill = make_skill("prod")

    def broken_route(req):
        raise RuntimeError("secret internal detail")

    skill.route = broken_route
    url = gateway(skill)
    with caplog.at_level("ERROR", logger="acelora.gateway"):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES}, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert any(rec.exc_info and "secret internal detail" in str(rec.exc_info[1]) for rec in caplog.records)


def test_fleet_server_added_by_the_admin_has_no_key(make_skill, gateway, upstream):
    skill = make_skill("prod", fleet=False, admin_key=ADMIN)
    url = gateway(skill)
    r = httpx.post(f"{url}/v1/fleet/servers", headers=bearer(ADMIN), timeout=10,
                   json={"name": "vllm-2", "endpoint": upstream.url})
    assert r.status_code == 201 and r.json()["has_api_key"] is False
    assert isinstance(skill.fleet.get("vllm-2"), ModelServer)

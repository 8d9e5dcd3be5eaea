"""Gateway auth, tenant isolation of /v1/models, and the fleet admin API."""

from __future__ import annotations

import httpx
import openai
import pytest

from acelora.trace import decode_header

MESSAGES = [{"role": "user", "content": "hi"}]
KEYS = {"sk-med": "tenant_med", "sk-other": "tenant_other"}
ADMIN = "sk-admin"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture()
def keyed(make_skill, gateway):
    return gateway(make_skill("prod", api_keys=KEYS, admin_key=ADMIN))


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), {"authorization": "Basic sk-med"}])
def test_missing_or_wrong_key_is_a_401_that_echoes_nothing(keyed, headers):
    r = httpx.post(f"{keyed}/v1/chat/completions", json={"model": "tiny-llama", "messages": MESSAGES},
                   headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "sk-" not in r.text and "tenant" not in r.text


def test_sdk_raises_authentication_error_without_a_valid_key(keyed):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_tenant_comes_from_the_key_and_a_sent_tenant_header_cannot_override_it(keyed, upstream):
    client = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-other", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="med-qa-v1", messages=MESSAGES, extra_headers={"x-ace-tenant-id": "tenant_med"})
    t = decode_header(raw.headers["x-ace-trace-multi-lora"])
    assert (t.tenant_id, t.fallback_reason) == ("tenant_other", "unknown_adapter")
    assert raw.parse().model == "tiny-llama"
    assert "x-ace-tenant-id" not in upstream.headers[-1]
    ok = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-med", max_retries=0)
    assert ok.chat.completions.create(model="med-qa-v1", messages=MESSAGES).model == "med-qa-v1"


def test_models_lists_the_base_and_only_the_callers_adapters(keyed):
    med = {m.id: m for m in openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-med").models.list()}
    other = {m.id for m in openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-other").models.list()}
    assert "tiny-llama" in med and "med-qa-v1" in med and "code-python-v2" in med
    assert "med-qa-v1" not in other and "code-python-v2" in other
    assert med["med-qa-v1"].model_extra["parent"] == "tiny-llama"
    assert med["tiny-llama"].model_extra["parent"] is None
    assert all(not str(m.model_extra.get("root", "")).startswith("/") for m in med.values())  # no paths leak


def test_open_gateway_takes_the_tenant_from_the_header(make_skill, gateway):
    url = gateway(make_skill("prod"))
    ids = {m["id"] for m in httpx.get(f"{url}/v1/models", headers={"x-ace-tenant-id": "tenant_med"}).json()["data"]}
    anon = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert "med-qa-v1" in ids and "med-qa-v1" not in anon


def test_fleet_routes_need_the_admin_key(keyed):
    assert httpx.get(f"{keyed}/v1/fleet").status_code == 401
    r = httpx.get(f"{keyed}/v1/fleet", headers=bearer("sk-med"))
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    r = httpx.get(f"{keyed}/v1/fleet", headers=bearer(ADMIN))
    assert r.status_code == 200 and [s["name"] for s in r.json()["data"]] == ["vllm-primary"]
    assert "api_key" not in r.text.replace("has_api_key", "")


def test_admin_adds_probes_lists_and_removes_a_server(make_skill, gateway, upstream):
    skill = make_skill("prod", fleet=False, api_keys=KEYS, admin_key=ADMIN)
    url = gateway(skill)
    upstream.adapters.add("code-python-v2")
    r = httpx.post(f"{url}/v1/fleet/servers", headers=bearer(ADMIN),
                   json={"name": "vllm-2", "endpoint": upstream.url, "kind": "vllm", "max_lora_rank": 16})
    assert r.status_code == 201, r.text
    card = r.json()
    assert card["base_model"] == "tiny-llama" and card["resident"] == ["code-python-v2"]
    assert card["runtime_loading"] is True and skill.fleet.get("vllm-2") is not None
    # the new server now serves routed requests, with the adapter already resident
    chat = httpx.post(f"{url}/v1/chat/completions", headers=bearer("sk-other"),
                      json={"model": "code-python-v2", "messages": MESSAGES})
    t = decode_header(chat.headers["x-ace-trace-multi-lora"])
    assert (t.action, t.served_by) == ("adapter_prefetched_applied", "vllm-2")
    assert httpx.post(f"{url}/v1/fleet/servers", headers=bearer(ADMIN),
                      json={"name": "vllm-2", "endpoint": upstream.url}).status_code == 409
    assert httpx.delete(f"{url}/v1/fleet/servers/vllm-2", headers=bearer("sk-med")).status_code == 403
    assert httpx.delete(f"{url}/v1/fleet/servers/vllm-2", headers=bearer(ADMIN)).json()["deleted"] is True
    assert httpx.delete(f"{url}/v1/fleet/servers/vllm-2", headers=bearer(ADMIN)).status_code == 404
    assert skill.fleet.get("vllm-2") is None


@pytest.mark.parametrize(("body", "status"), [
    ({"name": "x", "endpoint": "http://127.0.0.1:1", "kind": "vllm"}, 502),      # nothing listens there
    ({"name": "../x", "endpoint": "http://127.0.0.1:1"}, 400),
    ({"name": "x", "endpoint": "ftp://h"}, 400),
    ({"name": "x", "endpoint": "http://h", "kind": "tgi"}, 400),
    ({"name": "x", "endpoint": "http://h", "api_key_env": "AWS_SECRET_ACCESS_KEY"}, 400),
    ({"name": "x"}, 400),
])
def test_bad_server_registrations_are_refused(make_skill, gateway, body, status):
    skill = make_skill("prod", fleet=False, admin_key=ADMIN)
    url = gateway(skill)
    r = httpx.post(f"{url}/v1/fleet/servers", headers=bearer(ADMIN), json=body, timeout=20)
    assert r.status_code == status and "error" in r.json()
    assert len(skill.fleet) == 0

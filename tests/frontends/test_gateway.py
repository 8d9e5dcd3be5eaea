"""The gateway as a client sees it: OpenAI routes, /v1/execute, modes, every fallback, errors, streaming."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from acelora.trace import decode_header

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


def trace_of(r: httpx.Response):
    return decode_header(r.headers["x-ace-trace-multi-lora"])


def chat(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=10)


# -- the seed's curl examples, replayed literally ------------------------------------------------
def test_curl_chat_with_override_header_and_raw_extra_body_runs_the_adapter(make_skill, gateway, upstream):
    url = gateway(make_skill("shadow"))
    r = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                   headers={"Content-Type": "application/json", "x-ace-skill-override": "multi_lora=prod"},
                   content=json.dumps({"model": "tiny-llama", "messages": MESSAGES,
                                       "extra_body": {"lora_name": "code-python-v2"}}))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "code-python-v2"
    assert r.json()["choices"][0]["message"]["content"] == "[code-python-v2] hello"
    t = trace_of(r)
    assert (t.mode, t.action, t.adapter_name) == ("prod", "adapter_cold_loaded_applied", "code-python-v2")
    assert t.swap_ms is not None and t.swap_ms >= 0
    assert r.headers["x-ace-served-by"] == "vllm-primary"
    sent = upstream.received[-1]
    assert sent["model"] == "code-python-v2" and "extra_body" not in sent and "lora_name" not in sent
    assert upstream.loads == [{"lora_name": "code-python-v2", "lora_path": "/adapters/code-python-v2"}]


def test_curl_execute_native_shape_returns_output_and_trace(make_skill, gateway, upstream):
    url = gateway(make_skill("shadow"))
    r = httpx.post(f"{url}/v1/execute", timeout=10, headers={"Content-Type": "application/json"},
                   content=json.dumps({"input": {"messages": MESSAGES}, "target": {"model": "tiny-llama"},
                                       "skill_overrides": {"multi_lora": {"mode": "prod"}},
                                       "extra_body": {"lora_name": "code-python-v2", "adapter_rank": 8}}))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output"]["object"] == "chat.completion" and out["output"]["model"] == "code-python-v2"
    (event,) = out["trace"]
    assert event["skill"] == "multi_lora" and event["mode"] == "prod"
    assert event["action"] == "adapter_cold_loaded_applied" and event["adapter_name"] == "code-python-v2"
    assert event["served_by"] == "vllm-primary" and isinstance(event["timestamp"], float)
    assert event["vram_mb_saved"] == 510.0  # 512 MiB base - 2 MiB adapter
    assert set(event) >= {"adapter_hash", "tenant_id", "is_prefetch_hit", "swap_ms", "swap_ms_saved",
                          "fallback_reason", "overhead_ms", "request_id"}
    sent = upstream.received[-1]
    assert "extra_body" not in sent and "adapter_rank" not in sent and sent["messages"] == MESSAGES


# -- modes ---------------------------------------------------------------------------------------
def test_off_mode_passes_the_request_untouched_without_trace(make_skill, gateway, upstream):
    url = gateway(make_skill("off"))
    body = {"model": "tiny-llama", "messages": MESSAGES, "lora_name": "code-python-v2"}
    r = chat(url, body)
    assert r.status_code == 200 and r.json()["model"] == "tiny-llama"
    assert "x-ace-trace-multi-lora" not in r.headers
    assert upstream.received[-1]["lora_name"] == "code-python-v2"  # untouched, not even stripped
    assert upstream.loads == []


def test_shadow_mode_checks_but_does_not_rewrite_or_load(make_skill, gateway, upstream):
    url = gateway(make_skill("shadow"))
    r = chat(url, {"model": "tiny-llama", "messages": MESSAGES, "lora_name": "code-python-v2"})
    assert r.json()["model"] == "tiny-llama"
    t = trace_of(r)
    assert (t.mode, t.action, t.resident, t.fallback_reason) == ("shadow", "would_load_lora", False, None)
    assert upstream.loads == []


def test_shadow_mode_still_sends_another_tenants_adapter_to_the_base_model(make_skill, gateway, upstream):
    url = gateway(make_skill("shadow"))
    r = chat(url, {"model": "med-qa-v1", "messages": MESSAGES}, {"x-ace-tenant-id": "tenant_other"})
    assert r.json()["model"] == "tiny-llama" and upstream.received[-1]["model"] == "tiny-llama"
    assert trace_of(r).fallback_reason == "unknown_adapter"
    mine = chat(url, {"model": "med-qa-v1", "messages": MESSAGES}, {"x-ace-tenant-id": "tenant_med"})
    assert upstream.received[-1]["model"] == "med-qa-v1" and trace_of(mine).action == "would_load_lora"


def test_prod_mode_second_request_finds_the_adapter_resident(make_skill, gateway, upstream):
    skill = make_skill("prod")
    url = gateway(skill)
    body = {"model": "code-python-v2", "messages": MESSAGES}
    assert trace_of(chat(url, body)).action == "adapter_cold_loaded_applied"
    t = trace_of(chat(url, body))
    assert t.action == "adapter_prefetched_applied" and t.is_prefetch_hit and t.swap_ms == 0.0
    assert t.swap_ms_saved is not None and t.swap_ms_saved >= 0  # the first load was measured
    assert len(upstream.loads) == 1
    assert [e.action for e in skill.traces.all()] == ["adapter_cold_loaded_applied", "adapter_prefetched_applied"]


def test_prod_without_fleet_uses_the_default_upstream_and_loads_once(make_skill, gateway, upstream):
    url = gateway(make_skill("prod", fleet=False), upstream=upstream.url)
    body = {"model": "tiny-llama", "messages": MESSAGES, "lora_name": "code-python-v2"}
    assert chat(url, body).json()["model"] == "code-python-v2"
    assert trace_of(chat(url, body)).action == "adapter_prefetched_applied"
    assert len(upstream.loads) == 1


# -- every fallback reason, end to end -----------------------------------------------------------
@pytest.mark.parametrize(("lora", "reason"), [
    ("../../etc/passwd", "invalid_name"),
    ("no-such-adapter", "unknown_adapter"),
    ("mistral-helper", "incompatible_base"),
    ("big-rank-v1", "unsupported_by_engine"),
    ("dora-v1", "unsupported_by_engine"),
    ("broken-v1", "load_failed"),
])
def test_each_failure_falls_back_to_the_base_model_with_its_reason(make_skill, gateway, upstream, lora, reason):
    url = gateway(make_skill("prod"))
    r = chat(url, {"model": "tiny-llama", "messages": MESSAGES, "lora_name": lora})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-llama" and upstream.received[-1]["model"] == "tiny-llama"
    assert "lora_name" not in upstream.received[-1]
    t = trace_of(r)
    assert (t.action, t.fallback_reason) == ("fallback_base_model", reason)
    assert t.adapter_name == (None if reason == "invalid_name" else lora)


def test_adapter_of_another_tenant_looks_exactly_like_an_unknown_one(make_skill, gateway, upstream):
    url = gateway(make_skill("prod"))
    hdr = {"x-ace-tenant-id": "tenant_other"}
    forbidden = chat(url, {"model": "med-qa-v1", "messages": MESSAGES}, hdr)
    unknown = chat(url, {"model": "med-qa-v2", "messages": MESSAGES}, hdr)
    assert forbidden.status_code == unknown.status_code == 200
    tf, tu = trace_of(forbidden), trace_of(unknown)
    assert (tf.action, tf.fallback_reason, tf.adapter_hash) == (tu.action, tu.fallback_reason, tu.adapter_hash)
    assert tf.fallback_reason == "unknown_adapter" and tf.adapter_hash is None
    allowed = chat(url, {"model": "med-qa-v1", "messages": MESSAGES}, {"x-ace-tenant-id": "tenant_med"})
    assert allowed.json()["model"] == "med-qa-v1"


def test_reject_answers_404_without_listing_anything_and_the_sdk_raises_not_found(make_skill, gateway):
    url = gateway(make_skill("prod", on_unknown="reject"))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, extra_body={"lora_name": "med-qa-v1"},
                                       extra_headers={"x-ace-tenant-id": "tenant_other"})
    body = err.value.response.json()
    assert body["error"]["type"] == "NotFoundError" and body["error"]["param"] == "model"
    assert "med-qa-v1" in body["error"]["message"] and "code-python" not in body["error"]["message"]
    assert decode_header(err.value.response.headers["x-ace-trace-multi-lora"]).action == "rejected"
    r = chat(url, {"model": "no-such-v1", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `no-such-v1` does not exist."


# -- streaming, completions, SDK -----------------------------------------------------------------
def test_streaming_chat_passes_sse_through_with_trace_headers(make_skill, gateway, upstream):
    url = gateway(make_skill("prod"))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=MESSAGES, stream=True, extra_body={"lora_name": "code-python-v2"})
    assert trace_of(raw.http_response).action == "adapter_cold_loaded_applied"
    assert raw.headers["content-type"].startswith("text/event-stream")
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == "[code-python-v2] hello"


def test_completions_route_is_proxied_too(make_skill, gateway, upstream):
    url = gateway(make_skill("prod"))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="code-python-v2", prompt="def f(")
    assert out.model == "code-python-v2" and out.choices[0].text == "[code-python-v2] hello"


def test_upstream_errors_pass_through_with_status_and_body(make_skill, gateway, upstream):
    url = gateway(make_skill("off"))
    r = chat(url, {"model": "not-served", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("The model `not-served` does not exist")


def test_sdk_retries_through_the_gateway_when_the_upstream_fails_once(make_skill, gateway, upstream):
    url = gateway(make_skill("prod"))
    upstream.fail_next = 1
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=2)
    out = client.chat.completions.create(model="code-python-v2", messages=MESSAGES)
    assert out.model == "code-python-v2" and len(upstream.received) == 2


def test_vllm_upstream_gets_a_per_tenant_cache_salt(make_skill, gateway, upstream):
    url = gateway(make_skill("prod"), cache_salt_secret="s3cret")
    for tenant in ("tenant_a", "tenant_b", "tenant_a"):
        chat(url, {"model": "tiny-llama", "messages": MESSAGES, "cache_salt": "forged"}, {"x-ace-tenant-id": tenant})
    salts = [b["cache_salt"] for b in upstream.received]
    assert salts[0] == salts[2] != salts[1] and "forged" not in salts


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("content", "fragment"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": 3, "messages": []}', "'model' must be a string"),
    (b'{"model": "tiny-llama", "messages": "hi"}', "'messages' must be a list"),
])
def test_bad_bodies_get_400_in_openai_envelope(make_skill, gateway, upstream, content, fragment):
    url = gateway(make_skill("prod"))
    r = httpx.post(f"{url}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]
    assert upstream.received == []


@pytest.mark.parametrize("body", [
    {"input": {"messages": "hi"}},
    {"input": {}},
    {"input": {"messages": []}, "skill_overrides": {"multi_lora": {"mode": "banana"}}},
    {"input": {"messages": []}, "target": {"model": 7}},
    [],
])
def test_execute_validates_its_shape(make_skill, gateway, body):
    url = gateway(make_skill("prod"))
    r = httpx.post(f"{url}/v1/execute", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_bad_override_header_is_a_400_and_oversized_body_a_413(make_skill, gateway):
    url = gateway(make_skill("prod"), max_body_bytes=2048)
    r = chat(url, {"model": "tiny-llama", "messages": MESSAGES}, {"x-ace-skill-override": "multi_lora=banana"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-ace-skill-override"
    r = chat(url, {"model": "tiny-llama", "messages": [{"role": "user", "content": "x" * 4096}]})
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.post(f"{url}/v1/execute", json={"input": {"messages": [{"role": "user", "content": "x" * 4096}]}})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_no_upstream_at_all_is_a_503(make_skill, gateway):
    url = gateway(make_skill("prod", fleet=False))
    r = chat(url, {"model": "tiny-llama", "messages": MESSAGES})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_unknown_route_is_a_404_envelope_and_health_and_metrics_answer(make_skill, gateway):
    skill = make_skill("prod")
    url = gateway(skill)
    r = httpx.get(f"{url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{url}/healthz").json()["status"] == "ok"
    chat(url, {"model": "no-such-v1", "messages": MESSAGES})
    metrics = httpx.get(f"{url}/metrics").text
    assert 'acelora_multi_lora_requests_total{action="fallback_base_model",fallback_reason="unknown_adapter"' in metrics


def test_lora_prefetch_warms_the_next_adapter_in_the_background(make_skill, gateway, upstream):
    import time

    skill = make_skill("prod")
    url = gateway(skill)
    first = chat(url, {"model": "code-python-v2", "messages": MESSAGES,
                       "lora_prefetch": ["legal-compliance-v1", "med-qa-v1", "no-such-adapter"]})
    assert trace_of(first).adapter_name == "code-python-v2"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(upstream.loads) < 2:
        time.sleep(0.02)
    # the hinted adapter this (tenant-less) caller may use is loaded; another tenant's and unknown ones are not
    assert sorted(b["lora_name"] for b in upstream.loads) == ["code-python-v2", "legal-compliance-v1"]
    assert "lora_prefetch" not in upstream.received[-1]
    nxt = trace_of(chat(url, {"model": "legal-compliance-v1", "messages": MESSAGES}))
    assert nxt.action == "adapter_prefetched_applied" and nxt.swap_ms == 0.0 and nxt.swap_ms_saved is not None

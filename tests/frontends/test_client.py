"""wrap_openai: the real OpenAI SDK (sync and async), every feature unchanged, routed through the skill."""

from __future__ import annotations

import httpx
import openai
import pytest

from acelora.client import wrap_openai
from acelora.trace import decode_header

MESSAGES = [{"role": "user", "content": "hi"}]
NOWHERE = "http://127.0.0.1:9/v1"  # discard port: only a rewritten URL can succeed


def trace(raw) -> object:
    return decode_header(raw.headers["x-ace-trace-multi-lora"])


def test_returns_the_same_class_and_leaves_the_original_alone(make_skill, upstream):
    original = openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0)
    wrapped = wrap_openai(original, make_skill("prod", fleet=False))
    assert type(wrapped) is openai.OpenAI and wrapped.base_url == original.base_url
    raw = original.chat.completions.with_raw_response.create(model="tiny-llama", messages=MESSAGES,
                                                             extra_body={"lora_name": "code-python-v2"})
    assert "x-ace-trace-multi-lora" not in raw.headers and raw.parse().model == "tiny-llama"


def test_sync_without_fleet_loads_on_the_clients_server_and_applies(make_skill, upstream):
    skill = make_skill("prod", fleet=False)
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0), skill)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=MESSAGES, extra_body={"lora_name": "code-python-v2", "adapter_rank": 8})
    assert raw.parse().model == "code-python-v2"
    t = trace(raw)
    assert (t.action, t.adapter_name, t.served_by) == ("adapter_cold_loaded_applied", "code-python-v2", "127.0.0.1")
    assert raw.headers["x-ace-served-by"] == "127.0.0.1"
    assert upstream.loads[0]["lora_name"] == "code-python-v2"
    assert upstream.received[-1] == {"model": "code-python-v2", "messages": MESSAGES}
    assert skill.traces.last().action == "adapter_cold_loaded_applied"


def test_with_a_fleet_requests_go_to_the_chosen_server_with_its_key(make_skill, upstream, monkeypatch):
    monkeypatch.setenv("ACELORA_TEST_KEY", "sk-server")
    skill = make_skill("prod")
    skill.fleet.get("vllm-primary").api_key_env = "ACELORA_TEST_KEY"
    client = wrap_openai(openai.OpenAI(base_url=NOWHERE, api_key="sk-client", max_retries=0), skill)
    raw = client.chat.completions.with_raw_response.create(model="code-python-v2", messages=MESSAGES)
    assert raw.parse().model == "code-python-v2" and raw.headers["x-ace-served-by"] == "vllm-primary"
    assert upstream.headers[-1]["authorization"] == "Bearer sk-server"
    assert upstream.headers[-1]["host"] == upstream.url.removeprefix("http://")
    # base-model requests are routed to the fleet too
    assert client.chat.completions.create(model="tiny-llama", messages=MESSAGES).model == "tiny-llama"


@pytest.mark.parametrize(("lora", "reason"), [("no-such-v1", "unknown_adapter"), ("mistral-helper", "incompatible_base"),
                                              ("big-rank-v1", "unsupported_by_engine"), ("broken-v1", "load_failed")])
def test_fallbacks_run_on_the_base_model(make_skill, upstream, lora, reason):
    client = wrap_openai(openai.OpenAI(base_url=NOWHERE, api_key="x", max_retries=0), make_skill("prod"))
    raw = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MESSAGES,
                                                           extra_body={"lora_name": lora})
    assert raw.parse().model == "tiny-llama" and trace(raw).fallback_reason == reason


def test_tenant_of_the_wrapper_decides_what_it_may_use(make_skill, upstream):
    skill = make_skill("prod")
    base = openai.OpenAI(base_url=NOWHERE, api_key="x", max_retries=0)
    med = wrap_openai(base, skill, tenant="tenant_med")
    other = wrap_openai(base, skill, tenant="tenant_other")
    assert med.chat.completions.create(model="med-qa-v1", messages=MESSAGES).model == "med-qa-v1"
    raw = other.chat.completions.with_raw_response.create(model="med-qa-v1", messages=MESSAGES)
    assert raw.parse().model == "tiny-llama" and trace(raw).fallback_reason == "unknown_adapter"


def test_reject_raises_not_found_without_calling_upstream(make_skill, upstream):
    client = wrap_openai(openai.OpenAI(base_url=NOWHERE, api_key="x", max_retries=0),
                         make_skill("prod", on_unknown="reject"))
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, extra_body={"lora_name": "nope-v1"})
    assert err.value.body["message"] == "The model `nope-v1` does not exist."
    assert upstream.received == []


def test_bad_override_header_raises_bad_request(make_skill, upstream):
    client = wrap_openai(openai.OpenAI(base_url=NOWHERE, api_key="x", max_retries=0), make_skill("prod"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                       extra_headers={"x-ace-skill-override": "multi_lora=maybe"})


def test_sync_streaming_completions_and_other_endpoints(make_skill, upstream):
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0),
                         make_skill("prod"))
    stream = client.chat.completions.create(model="code-python-v2", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "[code-python-v2] hello"
    assert client.completions.create(model="code-python-v2", prompt="x").choices[0].text == "[code-python-v2] hello"
    assert "code-python-v2" in {m.id for m in client.models.list()}  # not routed: the client's own server


def test_sdk_retries_and_timeouts_keep_working(make_skill, upstream):
    skill = make_skill("prod")
    client = wrap_openai(openai.OpenAI(base_url=NOWHERE, api_key="x", max_retries=2), skill)
    upstream.fail_next = 1
    assert client.chat.completions.create(model="code-python-v2", messages=MESSAGES).model == "code-python-v2"
    assert len(upstream.received) == 2 and len(skill.traces) == 2
    upstream.delay_s = 2.0
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.2, max_retries=0).chat.completions.create(model="tiny-llama", messages=MESSAGES)


def test_shadow_and_off_leave_the_request_alone(make_skill, upstream):
    for mode, has_trace in (("shadow", True), ("off", False)):
        client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0),
                             make_skill(mode, fleet=False))
        raw = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MESSAGES,
                                                               extra_body={"lora_name": "code-python-v2"})
        assert raw.parse().model == "tiny-llama" and ("x-ace-trace-multi-lora" in raw.headers) is has_trace
        assert upstream.received[-1]["lora_name"] == "code-python-v2"
    assert upstream.loads == []


def test_legacy_httpx_client_under_the_sdk_is_wrapped_too(make_skill, upstream):
    original = openai.OpenAI(base_url=NOWHERE, api_key="x", max_retries=0, http_client=httpx.Client())
    client = wrap_openai(original, make_skill("prod"))
    assert isinstance(client._client, httpx.Client)
    assert client.chat.completions.create(model="code-python-v2", messages=MESSAGES).model == "code-python-v2"


def test_wrap_refuses_what_is_not_an_openai_client(make_skill):
    with pytest.raises(TypeError):
        wrap_openai(httpx.Client(), make_skill("prod"))


async def test_async_client_routes_streams_and_loads(make_skill, upstream):
    skill = make_skill("prod")
    client = wrap_openai(openai.AsyncOpenAI(base_url=NOWHERE, api_key="x", max_retries=0), skill, tenant="tenant_med")
    assert type(client) is openai.AsyncOpenAI
    raw = await client.chat.completions.with_raw_response.create(model="med-qa-v1", messages=MESSAGES)
    assert raw.parse().model == "med-qa-v1"
    t = trace(raw)
    assert (t.action, t.tenant_id, t.served_by) == ("adapter_cold_loaded_applied", "tenant_med", "vllm-primary")
    stream = await client.chat.completions.create(model="med-qa-v1", messages=MESSAGES, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "[med-qa-v1] hello"
    assert skill.traces.last().action == "adapter_prefetched_applied"
    assert [b["lora_name"] for b in upstream.loads] == ["med-qa-v1"]
    upstream.fail_next = 1
    retried = await client.with_options(max_retries=2).chat.completions.create(model="med-qa-v1", messages=MESSAGES)
    assert retried.model == "med-qa-v1"
    await client.close()


async def test_async_reject_and_fallback(make_skill, upstream):
    client = wrap_openai(openai.AsyncOpenAI(base_url=NOWHERE, api_key="x", max_retries=0),
                         make_skill("prod", on_unknown="reject"))
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope-v1", messages=MESSAGES)
    raw = await client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MESSAGES,
                                                                 extra_body={"lora_name": "broken-v1"})
    assert raw.parse().model == "tiny-llama" and trace(raw).fallback_reason == "load_failed"
    await client.close()

"""wrap_openai: off/shadow never change where a request goes, the client's key stays with its own origin,
and bodies no parser can take are a 400 the SDK raises."""

from __future__ import annotations

import openai
import pytest
from upstream import BASE, ServerThread, UpstreamState, create_upstream, make_registry

from acelora.client import wrap_openai
from acelora.fleet import Fleet, ModelServer
from acelora.skill import MultiLoRA

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def other():
    """A second upstream on loopback: same host as the client's, another port."""
    state = UpstreamState()
    with ServerThread(create_upstream(state)) as srv:
        state.url = srv.url  # type: ignore[attr-defined]
        yield state


def skill_on(server_url: str, mode: str) -> MultiLoRA:
    fleet = Fleet([ModelServer(name="fleet-b", endpoint=server_url, kind="vllm", base_model=BASE, max_lora_rank=16)])
    return MultiLoRA(registry=make_registry(), fleet=fleet, mode=mode, base_model=BASE)


@pytest.mark.parametrize(("mode", "override"), [("shadow", None), ("prod", "multi_lora=off"),
                                                ("prod", "multi_lora=shadow")])
def test_off_and_shadow_send_the_request_untouched_to_the_clients_own_base_url(upstream, other, mode, override):
    skill = skill_on(other.url, mode)
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-client", max_retries=0), skill)
    headers = {"x-custom": "1", **({"x-ace-skill-override": override} if override else {})}
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=MESSAGES, extra_body={"lora_name": "code-python-v2"}, extra_headers=headers)
    assert raw.parse().model == "tiny-llama" and other.received == []
    assert upstream.received == [{"model": "tiny-llama", "messages": MESSAGES, "lora_name": "code-python-v2"}]
    sent = upstream.headers[-1]
    assert sent["authorization"] == "Bearer sk-client" and sent["x-custom"] == "1"
    assert sent["host"] == upstream.url.removeprefix("http://")
    if raw.headers.get("x-ace-served-by"):  # shadow traces name where it really went
        assert raw.headers["x-ace-served-by"] == "127.0.0.1"
    assert upstream.loads == other.loads == []


def test_clients_key_is_not_sent_to_a_fleet_server_on_another_port_of_the_same_host(upstream, other):
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-client", max_retries=0),
                         skill_on(other.url, "prod"))
    assert client.chat.completions.create(model="code-python-v2", messages=MESSAGES).model == "code-python-v2"
    assert client.chat.completions.create(model="tiny-llama", messages=MESSAGES).model == "tiny-llama"
    assert len(other.headers) == 2 and all("authorization" not in h for h in other.headers)
    assert upstream.received == []


def test_clients_key_is_kept_for_a_fleet_server_at_its_own_origin(upstream):
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-client", max_retries=0),
                         skill_on(upstream.url, "prod"))
    assert client.chat.completions.create(model="code-python-v2", messages=MESSAGES).model == "code-python-v2"
    assert upstream.headers[-1]["authorization"] == "Bearer sk-client"


@pytest.mark.parametrize("content", [b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}", b"[1]", b"{oops"])
def test_unparsable_bodies_are_a_400_envelope_and_never_sent(upstream, content):
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="x", max_retries=0),
                         skill_on(upstream.url, "prod"))
    r = client._client.post(f"{upstream.url}/v1/chat/completions", content=content,
                            headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):
        client.post("/chat/completions", body=[1, 2], cast_to=object)
    assert upstream.received == []


async def test_async_shadow_goes_to_the_clients_base_url(upstream, other):
    client = wrap_openai(openai.AsyncOpenAI(base_url=f"{upstream.url}/v1", api_key="sk-client", max_retries=0),
                         skill_on(other.url, "shadow"))
    out = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                               extra_body={"lora_name": "code-python-v2"})
    assert out.model == "tiny-llama" and other.received == []
    assert upstream.received[-1] == {"model": "tiny-llama", "messages": MESSAGES, "lora_name": "code-python-v2"}
    await client.close()


def test_shadow_still_never_runs_another_tenants_adapter(upstream, other):
    skill = skill_on(other.url, "shadow")
    client = wrap_openai(openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-client", max_retries=0), skill,
                         tenant="tenant_other")
    raw = client.chat.completions.with_raw_response.create(model="med-qa-v1", messages=MESSAGES)  # tenant_med's
    assert raw.parse().model == "tiny-llama" and other.received == []
    assert upstream.received[-1]["model"] == "tiny-llama"  # same destination, but the base model
    assert "fallback_reason=unknown_adapter" in raw.headers["x-ace-trace-multi-lora"]

"""The engine server through the real openai SDK (and raw httpx for wire shapes) on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from engine_support import CHAT, wire

from acelora_kernels.tiny import TINY_MODEL_NAME


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def _keys(obj):
    """The nested key structure (dict key order included), ignoring values."""
    if isinstance(obj, dict):
        return [(k, _keys(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [_keys(v) for v in obj[:1]]
    return None


def test_every_demo_adapter_shows_its_marker_through_the_sdk(server, demo) -> None:
    client = _client(server)
    base = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, temperature=0, max_tokens=40)
    for name, marker in demo.markers.items():
        out = client.chat.completions.create(model=name, messages=CHAT, temperature=0, max_tokens=40)
        assert out.model == name
        assert out.choices[0].message.content.startswith(marker)
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert base.choices[0].message.content != out.choices[0].message.content
    assert not any(base.choices[0].message.content.startswith(m) for m in demo.markers.values())


def test_chat_response_has_vllms_exact_fields_and_order(server) -> None:
    fx = wire("vllm__chat_adapter_ok")
    r = httpx.post(server.url + "/v1/chat/completions", json=fx["request"]["json"], timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert _keys(r.json()) == _keys(fx["response"]["json"])
    assert r.json()["model"] == "code-python-v2" and r.json()["choices"][0]["message"]["content"].startswith(
        "[code]"
    )
    assert "x-acelora-timings" in r.headers


def test_sse_stream_matches_the_recorded_vllm_stream(server) -> None:
    fx = wire("vllm__chat_adapter_stream")
    want = [json.loads(line.removeprefix("data: ")) for line in fx["response"]["sse_lines"][:-1]]
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=fx["request"]["json"], timeout=60
    ) as r:
        assert r.headers["content-type"] == fx["response"]["headers"]["content-type"]
        body = r.read().decode()
    assert body.endswith("\n\ndata: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    got = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert _keys(got[0]) == _keys(want[0])  # role chunk
    assert all(_keys(c) == _keys(want[1]) for c in got[1:-2])  # content chunks
    assert _keys(got[-2]) == _keys(want[-2])  # finish chunk
    assert _keys(got[-1]) == _keys(want[-1])  # usage chunk
    text = "".join(c["choices"][0]["delta"]["content"] for c in got[:-1])
    plain = httpx.post(
        server.url + "/v1/chat/completions", json={**fx["request"]["json"], "stream": False}, timeout=60
    )
    assert text == plain.json()["choices"][0]["message"]["content"]
    assert got[-1]["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]


def test_stream_without_usage_puts_the_fingerprint_on_the_finish_chunk(server) -> None:
    client = _client(server)
    chunks = list(
        client.chat.completions.create(model="med-qa-v1", messages=CHAT, temperature=0, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].system_fingerprint
    assert "".join(c.choices[0].delta.content or "" for c in chunks).startswith("[med]")


def test_text_completions_json_and_stream(server) -> None:
    client = _client(server)
    prompt = "<|user|>hello<|end|><|assistant|>"
    out = client.completions.create(model="fin-analyst-v1", prompt=prompt, temperature=0, max_tokens=40)
    assert out.object == "text_completion" and out.choices[0].text.startswith("[fin]")
    streamed = client.completions.create(
        model="fin-analyst-v1",
        prompt=prompt,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_unknown_model_is_vllms_404_envelope(server) -> None:
    fx = wire("vllm__chat_unknown_model")
    with pytest.raises(openai.NotFoundError) as exc:
        _client(server).chat.completions.create(**fx["request"]["json"])
    body = exc.value.response.json()
    assert _keys(body) == _keys(fx["response"]["json"])
    assert body["error"] == {
        "message": f"The model `legal-compliance-v9` does not exist. Valid aliases: {TINY_MODEL_NAME}.",
        "type": "NotFoundError", "param": "model", "code": 404,
    }  # fmt: skip


def test_models_lists_base_then_adapters_like_vllm(server, demo) -> None:
    fx = wire("vllm__models_with_adapters")["response"]["json"]
    data = httpx.get(server.url + "/v1/models").json()
    assert _keys(data["data"][0]) == _keys(fx["data"][0]) and _keys(data["data"][1]) == _keys(fx["data"][1])
    base, *adapters = data["data"]
    assert (base["id"], base["parent"], base["owned_by"]) == (TINY_MODEL_NAME, None, "vllm")
    cards = {c["id"]: c for c in adapters}
    for name, path in demo.adapters.items():
        assert cards[name]["parent"] == TINY_MODEL_NAME and cards[name]["owned_by"] == "vllm"
        assert cards[name]["root"] == str(path) and cards[name]["max_model_len"] is None
    assert [m.id for m in _client(server).models.list()][0] == TINY_MODEL_NAME


async def test_concurrent_mixed_adapter_requests_do_not_cross_talk(server, demo) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    names = [None, *demo.adapters]

    async def one(i: int) -> tuple[str | None, str]:
        name = names[i % len(names)]
        model = name or TINY_MODEL_NAME
        msgs = [{"role": "user", "content": f"Question number {i}?"}]
        if i % 2:
            text = ""
            async for c in await client.chat.completions.create(
                model=model, messages=msgs, temperature=0, max_tokens=40, stream=True
            ):
                text += (c.choices[0].delta.content or "") if c.choices else ""
            return name, text
        out = await client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=40)
        assert out.model == model
        return name, out.choices[0].message.content

    results = await asyncio.gather(*(one(i) for i in range(12)))
    for name, text in results:
        if name is None:
            assert not any(text.startswith(m) for m in demo.markers.values())
        else:
            assert text.startswith(demo.markers[name]), (name, text)


def test_small_pool_queues_extra_adapters_and_answers_all(small_server, demo) -> None:
    async def run() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=small_server.url + "/v1", api_key="unused", max_retries=0)
        names = [*demo.adapters] * 2

        async def one(name: str) -> tuple[str, str]:
            out = await client.chat.completions.create(
                model=name, messages=CHAT, temperature=0, max_tokens=40
            )
            return name, out.choices[0].message.content

        return await asyncio.gather(*(one(n) for n in names))

    for name, text in asyncio.run(run()):
        assert text.startswith(demo.markers[name]), (name, text)
    info = httpx.get(small_server.url + "/acelora/info").json()
    assert info["pool"]["evictions"] >= 1 and info["max_loras"] == 2


def test_bad_request_bodies_are_400_envelopes_never_500(server) -> None:
    bad = [
        {"model": TINY_MODEL_NAME, "messages": []},
        {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        {"model": TINY_MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "n": 2},
        {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
        {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "x" * 5000}]},
        [1, 2, 3],
    ]
    for body in bad:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert (
            set(r.json()["error"]) == {"message", "type", "param", "code"}
            and r.json()["error"]["code"] == 400
        )
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    r = httpx.post(
        server.url + "/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": "x" * (70 << 10)}
    )
    assert r.status_code == 413


def test_health_and_metrics_report_lora_requests_like_vllm(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    _client(server).chat.completions.create(
        model="brand-voice-v1", messages=CHAT, temperature=0, max_tokens=4
    )
    text = httpx.get(server.url + "/metrics").text
    head = wire("vllm__metrics_lora_info")["response"]["text"].splitlines()[:2]
    assert all(line in text for line in head)
    series = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert any(
        'running_lora_adapters="brand-voice-v1",waiting_lora_adapters="brand-voice-v1"' in s for s in series
    )
    newest = max(series, key=lambda s: float(s.rsplit(" ", 1)[1]))
    assert 'running_lora_adapters=""' in newest  # nothing in flight now


def test_deeply_nested_json_under_the_size_cap_is_a_400_not_a_500(server) -> None:
    deep = b'{"model": ' + b"[" * 30000 + b"]" * 30000 + b"}"  # 60 KB, under the 64 KB cap
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter"):
        r = httpx.post(server.url + path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", (path, r.text)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_its_slot(server, engine):
    import time

    before = engine.stats["tokens"]
    with pytest.raises(httpx.TimeoutException):  # greedy base output of this prompt runs to max_tokens
        httpx.post(f"{server.url}/v1/completions", timeout=0.05,
                   json={"model": TINY_MODEL_NAME, "prompt": "zzzz", "max_tokens": 1000, "temperature": 0})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.snapshot()["num_running"]:
        time.sleep(0.02)
    assert engine.snapshot()["num_running"] == 0
    assert engine.stats["tokens"] - before < 1000  # cancelled, not generated to the end for nobody


@pytest.mark.parametrize("extra", [{"logprobs": True, "top_logprobs": 2}, {"prompt_logprobs": 1}])
def test_asking_for_logprobs_is_a_400_not_a_silent_null(server, extra):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400 and "log probabilities" in r.json()["error"]["message"]


@pytest.mark.parametrize("prompt", [[True, False], [1.0, 2.0]])
def test_booleans_and_floats_are_not_token_ids(server, prompt):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": prompt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"

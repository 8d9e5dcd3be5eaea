"""End to end against the embedded engine server (real model, real PEFT demo adapters, runtime loads).

The engine starts with no adapter loaded and runtime loading on, so acelora's loads are real; each demo
adapter makes greedy answers start with its marker (``[code]``, ``[med]``...), which proves which
weights ran. Skipped only where torch is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("torch")

from upstream import ServerThread  # noqa: E402

from acelora.client import wrap_openai  # noqa: E402
from acelora.fleet import Fleet, ModelServer  # noqa: E402
from acelora.registry import AdapterRegistry  # noqa: E402
from acelora.skill import MultiLoRA  # noqa: E402
from acelora.trace import decode_header  # noqa: E402

ASK = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from acelora_kernels.demo_adapters import demo_assets
    from acelora_kernels.serve_cli import build_app, build_parser

    assets = demo_assets(5)
    empty = tmp_path_factory.mktemp("no-static-adapters")
    args = build_parser().parse_args(["--adapters", str(empty), "--allowed-adapter-root", str(assets.adapters_dir),
                                      "--enable-runtime-lora", "--max-lora-rank", "64", "--max-tokens-cap", "64"])
    app, _ = build_app(args)
    with ServerThread(app) as srv:
        info = httpx.get(f"{srv.url}/acelora/info").json()  # base weight bytes: what vram_mb_saved is measured from
        yield {"url": srv.url, "assets": assets, "base_bytes": info["base_weight_bytes"]}
    app.state.server.engine.close()


@pytest.fixture()
def skill(engine: dict[str, Any]) -> MultiLoRA:
    """A fresh skill over the demo adapters; the engine is the one fleet server (probed by the gateway)."""
    registry = AdapterRegistry.from_dir(engine["assets"].adapters_dir, tenants={"tenant_med": ["med-qa-v1"]})
    server = ModelServer(name="engine", endpoint=engine["url"], kind="vllm", max_lora_rank=64,
                         base_model_bytes=engine["base_bytes"])
    return MultiLoRA(registry=registry, fleet=Fleet([server]), mode="prod")


def unload_all(engine: dict[str, Any]) -> None:
    for card in httpx.get(f"{engine['url']}/v1/models").json()["data"]:
        if card.get("parent"):
            httpx.post(f"{engine['url']}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


def test_gateway_cold_loads_then_reuses_a_real_adapter(engine, skill, gateway):
    unload_all(engine)
    url = gateway(skill)
    marker = engine["assets"].markers["code-python-v2"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    base = client.chat.completions.create(model=skill.fleet.get("engine").base_model, messages=ASK, max_tokens=16,
                                          temperature=0)
    assert not base.choices[0].message.content.startswith(marker)
    first = client.chat.completions.with_raw_response.create(
        model=base.model, messages=ASK, max_tokens=16, temperature=0, extra_body={"lora_name": "code-python-v2"})
    t = decode_header(first.headers["x-ace-trace-multi-lora"])
    assert (t.action, t.served_by) == ("adapter_cold_loaded_applied", "engine") and t.swap_ms > 0
    assert first.parse().model == "code-python-v2" and first.parse().choices[0].message.content.startswith(marker)
    second = client.chat.completions.with_raw_response.create(model="code-python-v2", messages=ASK, max_tokens=8)
    t2 = decode_header(second.headers["x-ace-trace-multi-lora"])
    assert t2.action == "adapter_prefetched_applied" and t2.swap_ms_saved is not None and t2.swap_ms_saved > 0
    spec = skill.registry.get("code-python-v2")
    assert t2.vram_mb_saved == round((engine["base_bytes"] - spec.size_bytes) / 2**20, 3)


def test_gateway_execute_and_tenant_isolation_on_the_engine(engine, skill, gateway):
    url = gateway(skill)
    med = engine["assets"].markers["med-qa-v1"]
    body = {"input": {"messages": ASK, "max_tokens": 12, "temperature": 0}, "target": {"model": "acelora/tiny-llama"},
            "skill_overrides": {"multi_lora": {"mode": "prod"}}, "extra_body": {"lora_name": "med-qa-v1"}}
    own = httpx.post(f"{url}/v1/execute", json=body, headers={"x-ace-tenant-id": "tenant_med"}, timeout=60).json()
    assert own["trace"][0]["adapter_name"] == "med-qa-v1" and own["trace"][0]["fallback_reason"] is None
    assert own["output"]["choices"][0]["message"]["content"].startswith(med)
    other = httpx.post(f"{url}/v1/execute", json=body, headers={"x-ace-tenant-id": "tenant_x"}, timeout=60).json()
    assert other["trace"][0]["fallback_reason"] == "unknown_adapter"
    assert not other["output"]["choices"][0]["message"]["content"].startswith(med)
    ids = {m["id"] for m in httpx.get(f"{url}/v1/models", headers={"x-ace-tenant-id": "tenant_x"}).json()["data"]}
    assert "med-qa-v1" not in ids and "code-python-v2" in ids


async def test_wrapped_async_client_streams_from_the_engine(engine, skill):
    from acelora.loading import probe_server

    async with httpx.AsyncClient() as probe:
        await probe_server(skill.fleet.get("engine"), probe)
    client = wrap_openai(openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                                            timeout=60), skill)
    marker = engine["assets"].markers["legal-compliance-v1"]
    stream = await client.chat.completions.create(model="legal-compliance-v1", messages=ASK, max_tokens=12,
                                                  temperature=0, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text.startswith(marker)
    assert skill.traces.last().adapter_name == "legal-compliance-v1" and skill.traces.last().served_by == "engine"
    await client.close()

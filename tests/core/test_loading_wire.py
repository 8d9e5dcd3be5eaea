"""The dialect code replays the recorded vLLM / SGLang exchanges of ../shared/wire exactly."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from acelora import AdapterRegistry, AdapterSpec, Fleet, ModelServer, MultiLoRA, RouteRequest
from acelora.loading import ensure_adapter, ensure_adapter_sync, probe_server, unload_adapter

WIRE = Path(__file__).resolve().parents[1] / "fixtures" / "wire"  # copied from ../shared/wire
BASE = "meta-llama/Llama-3.3-70B-Instruct"


def fixture(name):
    return json.loads((WIRE / f"{name}.json").read_text())


def replay(*names, seen=None):
    fx = [fixture(n) for n in names]

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request.method, request.url.path, json.loads(request.content or b"null")))
        for f in fx:
            if (request.method, request.url.path) == (f["request"]["method"], f["request"]["path"]):
                r = f["response"]
                if "json" in r:
                    body = json.dumps(r["json"]).encode()
                elif "sse_lines" in r:
                    body = "".join(line + "\n\n" for line in r["sse_lines"]).encode()
                else:
                    body = r["text"].encode()
                return httpx.Response(r["status"], headers=r["headers"], content=body)
        return httpx.Response(404, json={"detail": "Not Found"})

    return handler


def skill_for(kind="vllm"):
    reg = AdapterRegistry([AdapterSpec(name="code-python-v2", path="/models/adapters/code-python-v2", rank=8,
                                       size_bytes=1 << 20)])
    server = ModelServer(name="up", endpoint="http://up:8000", kind=kind, base_model=BASE, max_lora_rank=16)
    return MultiLoRA(registry=reg, fleet=Fleet([server]), mode="prod"), server


@pytest.mark.parametrize(
    ("kind", "fx", "action", "reason"),
    [
        ("vllm", "vllm__load_ok", "adapter_cold_loaded_applied", None),
        ("vllm", "vllm__load_duplicate", "adapter_prefetched_applied", None),
        ("vllm", "vllm__load_missing_path", "fallback_base_model", "load_failed"),
        ("vllm", "vllm__load_incompatible", "fallback_base_model", "load_failed"),
        ("vllm", "vllm__load_runtime_disabled", "fallback_base_model", "load_failed"),
        ("sglang", "sglang__load_ok", "adapter_cold_loaded_applied", None),
        ("sglang", "sglang__load_duplicate", "adapter_prefetched_applied", None),
        ("sglang", "sglang__load_incompatible", "fallback_base_model", "load_failed"),
    ],
)
def test_load_outcomes_in_each_dialect(kind, fx, action, reason):
    skill, server = skill_for(kind)
    seen = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(replay(fx, seen=seen)))
    d = asyncio.run(ensure_adapter(skill, skill.route(RouteRequest(model="code-python-v2")), client))
    assert (d.action, d.fallback_reason) == (action, reason)
    path = "/v1/load_lora_adapter" if kind == "vllm" else "/load_lora_adapter"
    assert seen[0] == ("POST", path, {"lora_name": "code-python-v2", "lora_path": "/models/adapters/code-python-v2"})
    # only "runtime loading disabled" asks /v1/models whether the adapter is served statically
    assert len(seen) == (2 if fx == "vllm__load_runtime_disabled" else 1)
    if reason is None:
        assert d.swap_ms is not None and d.swap_ms >= 0 and "code-python-v2" in server.resident
        event = skill.record(d)
        assert event.swap_ms == round(d.swap_ms, 3) and event.is_prefetch_hit is (action == "adapter_prefetched_applied")
        assert skill.route(RouteRequest(model="code-python-v2")).action == "adapter_prefetched_applied"
    else:
        assert d.model == BASE and "code-python-v2" not in server.resident


@pytest.mark.parametrize("sync", [False, True])
def test_runtime_loading_off_but_adapter_served_statically_counts_as_resident(sync):
    skill, server = skill_for("vllm")
    handler = replay("vllm__load_runtime_disabled", "vllm__models_with_adapters")
    decision = skill.route(RouteRequest(model="code-python-v2"))
    if sync:
        d = ensure_adapter_sync(skill, decision, httpx.Client(transport=httpx.MockTransport(handler)))
    else:
        d = asyncio.run(ensure_adapter(skill, decision, httpx.AsyncClient(transport=httpx.MockTransport(handler))))
    assert d.applied and d.resident and "code-python-v2" in server.resident


def test_sync_loading_matches_async():
    skill, server = skill_for("vllm")
    client = httpx.Client(transport=httpx.MockTransport(replay("vllm__load_ok")))
    d = ensure_adapter_sync(skill, skill.route(RouteRequest(model="code-python-v2")), client)
    assert d.applied and d.swap_ms is not None and "code-python-v2" in server.resident


def test_unreachable_server_falls_back_within_the_timeout():
    skill, _ = skill_for("vllm")
    skill.load_timeout_s = 0.5

    def hang(request):
        raise httpx.ReadTimeout("timed out", request=request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(hang))
    d = asyncio.run(ensure_adapter(skill, skill.route(RouteRequest(model="code-python-v2")), client))
    assert d.fallback_reason == "load_failed"


def test_concurrent_loads_of_one_adapter_are_single_flight():
    skill, server = skill_for("vllm")
    calls = []

    async def handler(request):
        calls.append(request.url.path)
        await asyncio.sleep(0.05)
        return httpx.Response(200, text="Success: LoRA adapter 'code-python-v2' added successfully.")

    async def main():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        decisions = [skill.route(RouteRequest(model="code-python-v2")) for _ in range(5)]
        return await asyncio.gather(*(ensure_adapter(skill, d, client) for d in decisions))

    out = asyncio.run(main())
    assert calls == ["/v1/load_lora_adapter"]
    assert all(d.applied and d.resident for d in out)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_unload_in_each_dialect(kind):
    _, server = skill_for(kind)
    server.resident.add("legal-compliance-v1")
    ok = httpx.AsyncClient(transport=httpx.MockTransport(replay(f"{kind}__unload_ok")))
    assert asyncio.run(unload_adapter(server, "legal-compliance-v1", ok))
    assert "legal-compliance-v1" not in server.resident
    unknown = httpx.AsyncClient(transport=httpx.MockTransport(replay(f"{kind}__unload_unknown")))
    assert not asyncio.run(unload_adapter(server, "legal-compliance-v1", unknown))


def test_probe_reads_vllm_models_and_runtime_loading():
    server = ModelServer(name="p", endpoint="http://up:8000", kind="vllm")
    client = httpx.AsyncClient(transport=httpx.MockTransport(replay("vllm__models_with_adapters",
                                                                    "vllm__load_runtime_disabled")))
    asyncio.run(probe_server(server, client))
    assert server.base_model == BASE
    assert server.resident == {a["id"] for a in fixture("vllm__models_with_adapters")["response"]["json"]["data"]
                               if a["parent"]}
    assert server.runtime_loading is False


def test_probe_reads_sglang_server_info():
    server = ModelServer(name="p", endpoint="http://up:30000", kind="sglang")
    client = httpx.AsyncClient(transport=httpx.MockTransport(replay("sglang__models_with_adapters",
                                                                    "sglang__server_info")))
    asyncio.run(probe_server(server, client))
    assert server.base_model == BASE and server.max_lora_rank == 16 and server.capacity == 7
    assert server.runtime_loading is True and "code-python-v2" in server.resident


def test_a_caller_that_gives_up_does_not_cancel_the_load_others_wait_for():
    skill, server = skill_for("vllm")

    async def handler(request):
        await asyncio.sleep(0.3)
        return httpx.Response(200, text="Success: LoRA adapter 'code-python-v2' added successfully.")

    async def main():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        impatient = skill.route(RouteRequest(model="code-python-v2"))
        patient = skill.route(RouteRequest(model="code-python-v2"))
        first = asyncio.ensure_future(asyncio.wait_for(ensure_adapter(skill, impatient, client), 0.05))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(ensure_adapter(skill, patient, client))
        with pytest.raises(asyncio.TimeoutError):
            await first
        return await second

    d = asyncio.run(main())
    assert d.applied and d.resident and "code-python-v2" in server.resident


def test_fleet_probe_updates_every_server_and_invalidates_cached_placements():
    skill, server = skill_for("vllm")
    server.max_lora_rank = 4  # too small for the rank-8 adapter
    assert skill.route(RouteRequest(model="code-python-v2")).fallback_reason == "unsupported_by_engine"
    bad = ModelServer(name="down", endpoint="http://down:1", kind="vllm", base_model=BASE)
    skill.fleet.add(bad)

    def handler(request):
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        return replay("sglang__models_with_adapters", "sglang__server_info", "vllm__load_runtime_disabled")(request)

    server.kind = "sglang"  # the probe reads SGLang's /server_info, which reports max_lora_rank 16
    errors = asyncio.run(skill.fleet.probe(httpx.AsyncClient(transport=httpx.MockTransport(handler))))
    assert errors["up"] is None and errors["down"].startswith("ConnectError")
    assert server.max_lora_rank == 16
    assert skill.route(RouteRequest(model="code-python-v2")).applied  # the cached "unsupported" is gone


def test_probe_reads_max_lora_from_vllm_metrics():
    server = ModelServer(name="p", endpoint="http://up:8000", kind="vllm")
    client = httpx.AsyncClient(transport=httpx.MockTransport(replay("vllm__models_with_adapters",
                                                                    "vllm__metrics_lora_info", "vllm__load_ok")))
    asyncio.run(probe_server(server, client))
    assert server.capacity == 4 and server.runtime_loading is True  # --max-loras 4 in the recording


def test_an_odd_server_fails_its_own_probe_without_stopping_the_others():
    good = ModelServer(name="good", endpoint="http://good:8000", kind="vllm")
    odd = ModelServer(name="odd", endpoint="http://odd:8000", kind="vllm")
    fleet = Fleet([good, odd])

    def handler(request):
        if request.url.host == "odd":
            return httpx.Response(200, json={"object": "list", "data": None})
        return replay("vllm__models_with_adapters", "vllm__load_runtime_disabled")(request)

    errors = asyncio.run(fleet.probe(httpx.AsyncClient(transport=httpx.MockTransport(handler))))
    assert errors["good"] is None and good.base_model == BASE
    assert errors["odd"].startswith("ValueError") and "model list" in errors["odd"]

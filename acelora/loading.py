"""Side effects of a decision: loading an adapter on its server, and probing servers.

Each server kind is a dialect (REFERENCE.md): vLLM ``/v1/load_lora_adapter`` (plain-text success, 400
"already been loaded", 404 ``{"detail": "Not Found"}`` = runtime loading disabled), SGLang
``/load_lora_adapter`` (always JSON with ``success``), OpenAI-compatible (no loading: an adapter is
available when ``/v1/models`` lists it). Every call has a bounded timeout; loads of one adapter on one
server are single-flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import httpx

from acelora.fleet import ModelServer
from acelora.skill import Decision, MultiLoRA
from acelora.trace import PREFETCHED_APPLIED

log = logging.getLogger("acelora.loading")


@dataclass(slots=True)
class LoadOutcome:
    """What a load call returned: ``ok`` (now resident), ``already`` (it was), or neither, with why."""

    ok: bool
    already: bool = False
    runtime_disabled: bool = False
    message: str = ""


def load_request(kind: str, endpoint: str, name: str, path: str) -> tuple[str, dict[str, Any]] | None:
    """URL and JSON body of a load call for a server kind (None when the kind cannot load at runtime)."""
    if kind == "vllm":
        return f"{endpoint}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
    if kind == "sglang":
        return f"{endpoint}/load_lora_adapter", {"lora_name": name, "lora_path": path}
    return None


def unload_request(kind: str, endpoint: str, name: str) -> tuple[str, dict[str, Any]] | None:
    if kind == "vllm":
        return f"{endpoint}/v1/unload_lora_adapter", {"lora_name": name}
    if kind == "sglang":
        return f"{endpoint}/unload_lora_adapter", {"lora_name": name}
    return None


def parse_load_response(kind: str, status: int, body: bytes) -> LoadOutcome:
    """Interpret a load response in the server's dialect."""
    text = body.decode("utf-8", "replace")[:2000]
    try:
        import json

        data = json.loads(text) if text.lstrip().startswith("{") else None
    except ValueError:
        data = None
    if kind == "sglang":
        if isinstance(data, dict):
            msg = str(data.get("error_message") or "")
            if data.get("success") is True:
                return LoadOutcome(True)
            return LoadOutcome(False, already="already loaded" in msg, message=msg)
        return LoadOutcome(False, message=f"HTTP {status}: {text[:200]}")
    if status == 200:
        return LoadOutcome(True)
    if isinstance(data, dict) and data.get("detail") == "Not Found":
        return LoadOutcome(False, runtime_disabled=True, message="runtime LoRA loading is disabled on this server")
    err = data.get("error") if isinstance(data, dict) else None
    msg = str(err.get("message", "")) if isinstance(err, dict) else text[:200]
    return LoadOutcome(False, already=status == 400 and "already been loaded" in msg, message=msg)


def _listed(outcome: LoadOutcome, models: httpx.Response, name: str) -> LoadOutcome:
    """With runtime loading off, an adapter is still servable when it was loaded at start-up
    (vLLM ``--lora-modules``): then ``/v1/models`` lists it."""
    try:
        ids = {c.get("id") for c in models.json().get("data", []) if isinstance(c, dict)}
    except (ValueError, AttributeError):
        return outcome
    if models.status_code == 200 and name in ids:
        return LoadOutcome(False, already=True, message="served statically")
    return LoadOutcome(False, runtime_disabled=True, message=outcome.message + f"; {name} is not among its models")


def _headers(server: ModelServer | None) -> dict[str, str]:
    key = server.api_key if server is not None else None
    return {"authorization": f"Bearer {key}"} if key else {}


def _target(skill: MultiLoRA, decision: Decision, base_url: str | None) -> tuple[str, str] | None:
    if decision.server is not None:
        return decision.server.kind, decision.server.endpoint
    if base_url:
        root = base_url.rstrip("/")
        return skill.engine, root[:-3] if root.endswith("/v1") else root
    return None


def _finish(skill: MultiLoRA, decision: Decision, outcome: LoadOutcome, ms: float, observe: bool = True) -> Decision:
    if outcome.ok or outcome.already:
        decision.swap_ms = ms
        if outcome.already and not outcome.ok:  # it was resident when the request arrived: nothing was loaded
            decision.action = PREFETCHED_APPLIED
        decision.resident = True
        decision.needs_load = False
        (decision.server.resident if decision.server is not None else skill.resident).add(decision.adapter or "")
        if outcome.ok and observe and decision.spec is not None:
            skill.observe_load(decision.spec.name, ms, decision.spec.size_bytes)
        return decision
    log.warning("loading %s failed: %s", decision.adapter, outcome.message)
    return decision.fall_back("load_failed")


# per event loop: (endpoint, adapter) -> the task loading it
_async_flights: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], asyncio.Task[Any]]] = (
    weakref.WeakKeyDictionary())
_sync_locks: dict[tuple[str, str], threading.Lock] = {}
_sync_guard = threading.Lock()


async def _load(kind: str, endpoint: str, decision: Decision, client: httpx.AsyncClient,
                timeout_s: float) -> tuple[LoadOutcome, float]:
    assert decision.spec is not None
    t0 = time.perf_counter()
    url, body = load_request(kind, endpoint, decision.spec.name, decision.spec.path)  # type: ignore[misc]
    headers = _headers(decision.server)
    try:
        r = await client.post(url, json=body, headers=headers, timeout=timeout_s)
        outcome = parse_load_response(kind, r.status_code, r.content)
        if outcome.runtime_disabled:
            m = await client.get(f"{endpoint}/v1/models", headers=headers, timeout=timeout_s)
            outcome = _listed(outcome, m, decision.spec.name)
    except httpx.HTTPError as e:
        outcome = LoadOutcome(False, message=f"{type(e).__name__}: {e}")
    return outcome, (time.perf_counter() - t0) * 1000


async def ensure_adapter(skill: MultiLoRA, decision: Decision, client: httpx.AsyncClient,
                         base_url: str | None = None, timeout_s: float | None = None) -> Decision:
    """Make the decision's adapter resident on its server (measured into ``swap_ms``), or fall back.
    ``timeout_s`` bounds the load call (default: the skill's ``load_timeout_s``).

    Loads of one adapter on one endpoint are single-flight: the load runs in its own task, and every
    caller waits on it through ``asyncio.shield``, so a caller that gives up (timeout, disconnect)
    cancels only its own wait, never the load the others are waiting for.

    >>> decision = await ensure_adapter(skill, skill.route(req), client)  # doctest: +SKIP
    """
    if not decision.needs_load or decision.spec is None:
        return decision
    target = _target(skill, decision, base_url)
    if target is None or target[0] == "openai":
        return decision
    kind, endpoint = target
    loop = asyncio.get_running_loop()
    flights = _async_flights.setdefault(loop, {})
    key = (endpoint, decision.spec.name)
    task = flights.get(key)
    leader = task is None
    if leader:
        task = loop.create_task(_load(kind, endpoint, decision, client, timeout_s or skill.load_timeout_s))
        flights[key] = task
        task.add_done_callback(lambda _t: flights.pop(key, None))
    t0 = time.perf_counter()
    outcome, ms = await asyncio.shield(task)
    if not leader:  # this caller waited for someone else's load
        return _finish(skill, decision, outcome, (time.perf_counter() - t0) * 1000, observe=False)
    return _finish(skill, decision, outcome, ms)


def ensure_adapter_sync(skill: MultiLoRA, decision: Decision, client: httpx.Client,
                        base_url: str | None = None, timeout_s: float | None = None) -> Decision:
    """Blocking :func:`ensure_adapter` for synchronous clients (single-flight through a per-key lock)."""
    if not decision.needs_load or decision.spec is None:
        return decision
    target = _target(skill, decision, base_url)
    if target is None or target[0] == "openai":
        return decision
    kind, endpoint = target
    with _sync_guard:
        lock = _sync_locks.setdefault((endpoint, decision.spec.name), threading.Lock())
    t0 = time.perf_counter()
    with lock:
        if decision.spec.name in (decision.server.resident if decision.server is not None else skill.resident):
            # another thread loaded it while this one waited for the lock
            return _finish(skill, decision, LoadOutcome(True), (time.perf_counter() - t0) * 1000, observe=False)
        url, body = load_request(kind, endpoint, decision.spec.name, decision.spec.path)  # type: ignore[misc]
        headers = _headers(decision.server)
        try:
            timeout = timeout_s or skill.load_timeout_s
            r = client.post(url, json=body, headers=headers, timeout=timeout)
            outcome = parse_load_response(kind, r.status_code, r.content)
            if outcome.runtime_disabled:
                m = client.get(f"{endpoint}/v1/models", headers=headers, timeout=timeout)
                outcome = _listed(outcome, m, decision.spec.name)
        except httpx.HTTPError as e:
            outcome = LoadOutcome(False, message=f"{type(e).__name__}: {e}")
    return _finish(skill, decision, outcome, (time.perf_counter() - t0) * 1000)


async def unload_adapter(server: ModelServer, name: str, client: httpx.AsyncClient, timeout_s: float = 30.0) -> bool:
    """Unload ``name`` from ``server``; True when the server confirmed it."""
    req = unload_request(server.kind, server.endpoint, name)
    if req is None:
        return False
    try:
        r = await client.post(req[0], json=req[1], headers=_headers(server), timeout=timeout_s)
    except httpx.HTTPError:
        return False
    ok = r.status_code == 200
    if server.kind == "sglang":
        ok = ok and parse_load_response("sglang", r.status_code, r.content).ok
    if ok:
        server.resident.discard(name)
    return ok


def _object(r: httpx.Response) -> dict[str, Any]:
    """A JSON object body, or {} for anything else (a probe reads what it can and ignores the rest)."""
    try:
        data = r.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _max_lora_from_metrics(text: str) -> int | None:
    """``max_lora`` of the newest ``vllm:lora_requests_info`` series (its value is the time it was set)."""
    from prometheus_client.parser import text_string_to_metric_families

    newest: tuple[float, int] | None = None
    try:
        for family in text_string_to_metric_families(text):
            if family.name != "vllm:lora_requests_info":
                continue
            for sample in family.samples:
                raw = sample.labels.get("max_lora", "")
                if raw.isdigit() and (newest is None or sample.value > newest[0]):
                    newest = (sample.value, int(raw))
    except ValueError:  # not the Prometheus text format
        return None
    return newest[1] if newest else None


async def probe_server(server: ModelServer, client: httpx.AsyncClient, timeout_s: float = 10.0) -> ModelServer:
    """Ask ``server`` what it serves and supports; fills ``base_model``, ``resident``, ``runtime_loading``,
    ``max_lora_rank`` and ``capacity`` where the server exposes them. Raises ``httpx.HTTPError`` when it
    cannot be reached and ``ValueError`` when ``/v1/models`` is not an OpenAI model list."""
    headers = _headers(server)
    r = await client.get(f"{server.openai_base_url}/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    data = _object(r).get("data")
    if not isinstance(data, list):
        raise ValueError(f"{server.openai_base_url}/models did not answer an OpenAI model list")
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    bases = [c["id"] for c in cards if not c.get("parent")]
    if server.base_model is None and bases:
        server.base_model = bases[0]
    server.resident = {c["id"] for c in cards if c.get("parent")}  # vLLM and SGLang list loaded adapters
    if server.kind == "vllm":
        # acelora's embedded engine says more than vLLM does (vLLM answers 404 here).
        info = _object(await client.get(f"{server.endpoint}/acelora/info", headers=headers, timeout=timeout_s))
        if isinstance(info.get("base_weight_bytes"), int) and server.base_model_bytes is None:
            server.base_model_bytes = info["base_weight_bytes"]
        if isinstance(info.get("max_lora_rank"), int) and server.max_lora_rank is None:
            server.max_lora_rank = info["max_lora_rank"]
        m = await client.get(f"{server.endpoint}/metrics", headers=headers, timeout=timeout_s)
        max_lora = _max_lora_from_metrics(m.text) if m.status_code == 200 else None
        if max_lora:
            server.capacity = max_lora
        # An empty load is harmless: 400 (fields missing) when runtime loading is on, 404 when it is off.
        r = await client.post(f"{server.endpoint}/v1/load_lora_adapter", json={"lora_name": "", "lora_path": ""},
                              headers=headers, timeout=timeout_s)
        server.runtime_loading = r.status_code != 404
    elif server.kind == "sglang":
        r = await client.get(f"{server.endpoint}/server_info", headers=headers, timeout=timeout_s)
        if r.status_code == 404:
            r = await client.get(f"{server.endpoint}/get_server_info", headers=headers, timeout=timeout_s)
        info = _object(r) if r.status_code == 200 else {}
        if info:
            server.runtime_loading = bool(info.get("enable_lora"))
            if isinstance(info.get("max_lora_rank"), int):
                server.max_lora_rank = info["max_lora_rank"]
            if isinstance(info.get("max_loras_per_batch"), int):
                server.capacity = max(1, info["max_loras_per_batch"] - 1)  # the base model takes one slot
    else:
        server.runtime_loading = False
    return server

"""The gateway's upstream hop: where a request goes, and streaming it there and back with bounded timeouts.

Before the first byte reaches the client the hop may still change its mind: a fleet server that refuses
the connection is cooled down and the request re-routed to the next one, and an adapter the gateway
believed resident that the upstream no longer knows (404) is loaded again, or the request falls back to
the base model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from acelora import jsonbody
from acelora.fleet import ModelServer, same_base
from acelora.middleware import openai_error
from acelora.skill import Decision, Mode, MultiLoRA, RouteRequest
from acelora.trace import COLD_LOADED_APPLIED

log = logging.getLogger("acelora.gateway")

# Hop-by-hop and framing headers are the proxy's business, not the upstream's.
_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                   "proxy-authenticate", "proxy-authorization", "content-encoding", "server", "date"})
# Only acelora writes traces: an upstream's would be relayed to the client as if they were ours.
_FORGED_PREFIX = "x-ace-trace-"
_SERVED_BY = "x-ace-served-by"
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
DEFAULT_COOLDOWN_S = 10.0
DEFAULT_MAX_STREAM_S = 900.0  # a whole streamed answer; each read is bounded by the gateway's timeout_s
Loader = Callable[[MultiLoRA, Decision], Awaitable[Decision]]


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | int | None = None) -> Response:
    """A Starlette response carrying OpenAI's error envelope.

    >>> error_response(503, "No upstream server is configured.", "ServiceUnavailableError").status_code
    503
    """
    return Response(openai_error(status, message, type_, param, code), status_code=status,
                    media_type="application/json")


def cache_salt(secret: bytes, tenant: str) -> str:
    """vLLM's per-tenant ``cache_salt``: tenants never share prefix-cache blocks (a timing channel otherwise).

    >>> len(cache_salt(b"k", "tenant_dev_01"))
    32
    """
    return hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]


def pick_upstream(skill: MultiLoRA, decision: Decision | None, model: Any,
                  default: ModelServer | None) -> ModelServer | None:
    """The decision's server, else the configured default upstream, else a healthy fleet server of ``model``.

    >>> pick_upstream(skill, decision, "meta-llama/Llama-3.3-70B-Instruct", None).name  # doctest: +SKIP
    'vllm-primary'
    """
    if decision is not None and decision.server is not None:
        return decision.server
    if default is not None:
        return default
    servers = [s for s in skill.fleet.servers if s.healthy]
    if isinstance(model, str):
        same = [s for s in servers if same_base(s.base_model, model)]
        servers = same or servers
    return servers[0] if servers else None


def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    """The upstream's response headers the client may see: no hop-by-hop headers, no forged acelora traces.

    >>> relayed_headers(httpx.Response(200, headers={"x-ace-served-by": "evil", "x-request-id": "1"}))
    {'x-request-id': '1'}
    """
    out = {}
    for k, v in upstream.headers.items():
        low = k.lower()
        if low in _DROP or low == _SERVED_BY or low.startswith(_FORGED_PREFIX):
            continue
        out[k] = v
    if "content-encoding" in upstream.headers:  # we relay decoded bytes, so the length changes
        out.pop("content-length", None)
    return out


class Health:
    """Cooldowns of fleet servers that refused a connection: ``healthy=False`` until ``down_until[name]``.

    >>> health = Health(cooldown_s=10.0)  # doctest: +SKIP
    >>> health.mark_down(server); server.healthy  # doctest: +SKIP
    False
    """

    def __init__(self, cooldown_s: float = DEFAULT_COOLDOWN_S) -> None:
        self.cooldown_s = cooldown_s
        self.down_until: dict[str, float] = {}
        self._servers: dict[str, ModelServer] = {}

    def mark_down(self, server: ModelServer) -> None:
        """Take ``server`` out of routing (``route()`` skips unhealthy servers) for the cooldown."""
        until = time.monotonic() + self.cooldown_s
        server.healthy = False
        self.down_until[server.name] = until
        self._servers[server.name] = server
        log.warning("server %s refused the connection; out of routing for %.0f s", server.name, self.cooldown_s)
        # A timer brings it back even when no request comes through the gateway in between.
        asyncio.get_running_loop().call_later(self.cooldown_s, self.revive_expired)

    def revive_expired(self) -> None:
        """Mark healthy again every server whose cooldown has passed."""
        now = time.monotonic()
        for name, until in list(self.down_until.items()):
            if now >= until:
                del self.down_until[name]
                self._servers.pop(name).healthy = True


@dataclass(slots=True)
class Outcome:
    """What finally happened to one proxied request: the upstream's answer, or an error to send instead."""

    decision: Decision | None
    server: ModelServer | None
    response: httpx.Response | None = None
    error: Response | None = None


def _error(status: int, server: ModelServer | None) -> Response:
    name = server.name if server is not None else "upstream"
    if status == 504:
        return error_response(504, f"Upstream server {name} did not answer in time.", "GatewayTimeoutError")
    if status == 503:
        return error_response(503, "No upstream server is configured for this model.", "ServiceUnavailableError")
    return error_response(502, f"Upstream server {name} could not be reached.", "BadGatewayError")


@dataclass(slots=True)
class Proxy:
    """Sends one JSON body to an upstream's OpenAI route, failing over and reloading before the first byte.

    >>> proxy = Proxy(skill, httpx.AsyncClient(), httpx.Timeout(120, connect=5), health, loader)  # doctest: +SKIP
    >>> outcome = await proxy.send(decision, body, "chat/completions", tenant="t", stream=True)  # doctest: +SKIP
    """

    skill: MultiLoRA
    client: httpx.AsyncClient
    timeout: httpx.Timeout
    health: Health
    loader: Loader
    default: ModelServer | None = None
    salt_secret: bytes | None = None

    def _request(self, server: ModelServer, suffix: str, body: dict[str, Any], tenant: str | None) -> httpx.Request:
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        key = server.api_key
        if key:
            headers["authorization"] = f"Bearer {key}"
        if server.kind == "vllm" and tenant is not None and self.salt_secret is not None:
            body = {**body, "cache_salt": cache_salt(self.salt_secret, tenant)}
        return self.client.build_request("POST", f"{server.openai_base_url}/{suffix}", content=jsonbody.dumps(body),
                                         headers=headers, timeout=self.timeout)

    async def send(self, decision: Decision | None, body: dict[str, Any], suffix: str, tenant: str | None,
                   stream: bool) -> Outcome:
        """The upstream's answer (body unread when ``stream``), after at most one attempt per fleet server."""
        self.health.revive_expired()
        attempts = max(1, len(self.skill.fleet))
        tried: list[ModelServer] = []
        stale = 0
        while True:
            server = pick_upstream(self.skill, decision, body.get("model"), self.default)
            if server is None or any(server is t for t in tried):
                return Outcome(decision, server, error=_error(502 if tried else 503, server))
            try:
                r = await self.client.send(self._request(server, suffix, body, tenant), stream=stream)
            except CONNECT_ERRORS:
                tried.append(server)
                if self.skill.fleet.get(server.name) is server:
                    self.health.mark_down(server)
                if len(tried) >= attempts:
                    return Outcome(decision, server, error=_error(502, server))
                decision, body = await self._reroute(decision, body)
                continue
            except httpx.TimeoutException:
                return Outcome(decision, server, error=_error(504, server))
            except httpx.HTTPError:
                return Outcome(decision, server, error=_error(502, server))
            if r.status_code == 404 and decision is not None and decision.applied and stale < 2:
                # The upstream forgot an adapter we believed resident (restart, LRU, another operator).
                await r.aclose()
                decision = await self._reload(decision, server) if stale == 0 else decision.fall_back("load_failed")
                body = decision.apply(body)
                stale += 1
                continue
            return Outcome(decision, server, response=r)

    async def call_json(self, decision: Decision | None, body: dict[str, Any], suffix: str,
                        tenant: str | None) -> tuple[Outcome, int, Any]:
        """A whole (non-streaming) call: (outcome, status, parsed JSON or an error envelope)."""
        outcome = await self.send(decision, body, suffix, tenant, stream=False)
        if outcome.error is not None:
            return outcome, outcome.error.status_code, json.loads(bytes(outcome.error.body))
        r = outcome.response
        assert r is not None
        try:
            return outcome, r.status_code, r.json()
        except (ValueError, RecursionError):
            name = outcome.server.name if outcome.server else "upstream"
            return outcome, 502, json.loads(openai_error(502, f"Upstream server {name} sent a non-JSON answer.",
                                                         "BadGatewayError"))

    async def _reload(self, decision: Decision, server: ModelServer) -> Decision:
        name = decision.adapter or ""
        server.resident.discard(name)
        if decision.server is None:
            self.skill.resident.discard(name)
        log.warning("server %s no longer serves adapter %s; loading it again", server.name, name)
        again = dataclasses.replace(decision, action=COLD_LOADED_APPLIED, resident=False, needs_load=True,
                                    swap_ms=None)
        return await self.loader(self.skill, again)

    async def _reroute(self, decision: Decision | None, body: dict[str, Any]) -> tuple[Decision | None, dict[str, Any]]:
        """The same request routed again now that a server is out (route() skips unhealthy servers)."""
        if decision is None or decision.mode is Mode.OFF:
            return decision, body  # not consulted: pick_upstream takes the next healthy server
        if decision.adapter is not None:
            new = self.skill.route(RouteRequest(model=decision.base, lora_name=decision.adapter, tenant=decision.tenant,
                                                mode=decision.mode, request_id=decision.request_id))
            if new.needs_load:
                new = await self.loader(self.skill, new)
            return new, new.apply(body) if new.mode is Mode.PROD else body
        model = body.get("model")
        base = self.skill.route(RouteRequest(model=model if isinstance(model, str) else None, tenant=decision.tenant,
                                             mode=Mode.PROD))
        return dataclasses.replace(decision, server=base.server), body


def relay(upstream: httpx.Response, max_s: float | None = None) -> StreamingResponse:
    """The upstream's status, headers and body as a Starlette response, streamed as they arrive (SSE included).

    Each read is bounded by the client's timeout; ``max_s`` bounds the whole answer, so an upstream that
    drips forever cannot hold the connection forever. A stream cut that way ends with an error event.
    """
    is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks() -> AsyncIterator[bytes]:
        deadline = None if max_s is None else time.monotonic() + max_s
        parts = upstream.aiter_bytes()
        try:
            while True:
                if deadline is None:
                    chunk = await anext(parts)
                else:
                    chunk = await asyncio.wait_for(anext(parts), max(0.0, deadline - time.monotonic()))
                yield chunk
        except StopAsyncIteration:
            pass
        except TimeoutError:
            log.warning("cut a streamed answer after %gs (max_stream_s)", max_s)
            if is_sse:
                yield b"data: " + openai_error(504, f"The answer took longer than {max_s:g}s.", "GatewayTimeoutError") + b"\n\n"
        finally:
            await upstream.aclose()

    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=relayed_headers(upstream))

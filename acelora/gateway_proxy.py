"""The gateway's upstream hop: where a request goes, and streaming it there and back with bounded timeouts."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

from acelora import jsonbody
from acelora.fleet import ModelServer, same_base
from acelora.middleware import openai_error
from acelora.skill import Decision, MultiLoRA

# Hop-by-hop and framing headers are the proxy's business, not the upstream's.
_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                   "proxy-authenticate", "proxy-authorization", "content-encoding", "server", "date"})


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


@dataclass(slots=True)
class Proxy:
    """Sends one JSON body to an upstream's OpenAI route and streams the answer back untouched.

    >>> proxy = Proxy(httpx.AsyncClient(), timeout=httpx.Timeout(120, connect=5))  # doctest: +SKIP
    >>> response = await proxy.forward(server, "chat/completions", body)  # doctest: +SKIP
    """

    client: httpx.AsyncClient
    timeout: httpx.Timeout

    def _request(self, server: ModelServer, suffix: str, body: dict[str, Any]) -> httpx.Request:
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        key = server.api_key
        if key:
            headers["authorization"] = f"Bearer {key}"
        data = jsonbody.dumps(body)
        return self.client.build_request("POST", f"{server.openai_base_url}/{suffix}", content=data,
                                         headers=headers, timeout=self.timeout)

    async def forward(self, server: ModelServer, suffix: str, body: dict[str, Any]) -> Response:
        """Upstream's status, headers and body, streamed as they arrive (SSE included)."""
        try:
            upstream = await self.client.send(self._request(server, suffix, body), stream=True)
        except httpx.TimeoutException:
            return error_response(504, f"Upstream server {server.name} did not answer in time.", "GatewayTimeoutError")
        except httpx.HTTPError:
            return error_response(502, f"Upstream server {server.name} could not be reached.", "BadGatewayError")
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP}
        if "content-encoding" in upstream.headers:  # we relay decoded bytes, so the length changes
            headers.pop("content-length", None)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)

    async def call_json(self, server: ModelServer, suffix: str, body: dict[str, Any]) -> tuple[int, Any]:
        """A whole (non-streaming) call: (status, parsed JSON or an error envelope for non-JSON answers)."""
        try:
            r = await self.client.send(self._request(server, suffix, body))
        except httpx.TimeoutException:
            return 504, json.loads(openai_error(504, f"Upstream server {server.name} did not answer in time.",
                                                "GatewayTimeoutError"))
        except httpx.HTTPError:
            return 502, json.loads(openai_error(502, f"Upstream server {server.name} could not be reached.",
                                                "BadGatewayError"))
        try:
            return r.status_code, r.json()
        except ValueError:
            return 502, json.loads(openai_error(502, f"Upstream server {server.name} sent a non-JSON answer.",
                                                "BadGatewayError"))

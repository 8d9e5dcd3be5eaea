"""``create_gateway(skill)``: an OpenAI-compatible ingress built from :class:`MultiLoRAMiddleware`.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (proxied, streaming passthrough),
``POST /v1/execute`` (the native request/trace shape), ``GET /v1/models`` (per tenant), fleet admin
(``/v1/fleet``, admin key only), ``/metrics`` and ``/healthz``. Run it with ``acelora gateway --config``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from acelora import jsonbody
from acelora.errors import AceloraError, InvalidRequest, describe_validation_error
from acelora.fleet import ModelServer
from acelora.gateway_auth import ADMIN_KEY, GatewayAuth, downgrade_denied_body, is_downgrade, may_downgrade
from acelora.gateway_proxy import DEFAULT_MAX_STREAM_S, Health, Outcome, Proxy, error_response, relay
from acelora.middleware import (
    DECISION_KEY,
    DEFAULT_MAX_BODY,
    SERVED_BY_KEY,
    TENANT_KEY,
    MultiLoRAMiddleware,
    event_headers,
    not_found_body,
    requested_name,
    trace_headers,
)
from acelora.skill import TENANT_HEADER, Decision, Mode, MultiLoRA, RouteRequest

log = logging.getLogger("acelora.gateway")
_FLEET_DENIED = ("Fleet routes need the admin key: configure one ([gateway] admin_key_env) and send it as "
                 "'Authorization: Bearer <key>'.")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExecuteInput(BaseModel):
    model_config = ConfigDict(extra="allow")  # max_tokens, temperature, ... go upstream as given
    messages: list[dict[str, Any]]


class ExecuteTarget(_Strict):
    model: str | None = None


class ModeOverride(_Strict):
    mode: Literal["off", "shadow", "prod"] | None = None


class SkillOverrides(BaseModel):
    multi_lora: ModeOverride | None = None


class ExecuteRequest(_Strict):
    """Body of ``POST /v1/execute``.

    >>> ExecuteRequest.model_validate({"input": {"messages": []}}).target.model is None
    True
    """

    input: ExecuteInput
    target: ExecuteTarget = Field(default_factory=ExecuteTarget)
    skill_overrides: SkillOverrides | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)


class ServerIn(_Strict):
    """Body of ``POST /v1/fleet/servers``. No ``api_key_env``: servers that need a key are declared in the
    config file (a caller must not make the gateway send an env secret to an endpoint of its choosing).

    >>> ServerIn(name="vllm-2", endpoint="http://gpu2:8000").kind
    'vllm'
    """

    name: str
    endpoint: str
    kind: Literal["vllm", "sglang", "openai"] = "vllm"
    base_model: str | None = None
    capacity: int = Field(8, ge=1)
    max_lora_rank: int | None = Field(None, ge=1)
    base_model_bytes: int | None = Field(None, ge=0)


def _tenant(scope: dict[str, Any]) -> str | None:
    if TENANT_KEY in scope:  # set by GatewayAuth when keys are configured
        return scope[TENANT_KEY]
    for k, v in scope["headers"]:
        if k == TENANT_HEADER.encode():
            return v.decode("latin-1")
    return None


def _bad_request(message: str, param: str | None = None) -> Response:
    return error_response(400, message, "BadRequestError", param)


def _validation_message(e: ValidationError) -> str:
    return "{}: {}".format(*describe_validation_error(e, "body"))


class BodyTooLarge(AceloraError):
    """A request body over the gateway's ``max_body_bytes`` (answered 413).

    >>> raise BodyTooLarge("Request body is larger than 4194304 bytes.")  # doctest: +SKIP
    """


async def _json_body(request: Request, limit: int) -> Any:
    """The request's JSON, read with a bound (routes the middleware does not buffer need their own)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"Request body is larger than {limit} bytes.")
        chunks.append(chunk)
    try:
        return jsonbody.loads(b"".join(chunks))
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        raise InvalidRequest("Request body is not valid JSON.") from None


class Gateway:
    """State and handlers of one gateway app (see :func:`create_gateway`).

    >>> create_gateway(skill).state.gateway.skill is skill  # doctest: +SKIP
    True
    """

    def __init__(self, skill: MultiLoRA, upstream: ModelServer | None, timeout: httpx.Timeout,
                 salt_secret: bytes, http_client: httpx.AsyncClient | None, max_body_bytes: int) -> None:
        self.skill = skill
        self.max_body_bytes = max_body_bytes
        self.max_stream_s = DEFAULT_MAX_STREAM_S
        self.upstream = upstream
        self.timeout = timeout
        self.salt_secret = salt_secret
        self._client = http_client
        self._own_client = http_client is None
        self.created = int(time.time())
        self.health = Health()

    def proxy_for(self) -> Proxy:
        return Proxy(self.skill, self.client, self.timeout, self.health, self.load, self.upstream, self.salt_secret)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def load(self, skill: MultiLoRA, decision: Decision) -> Decision:
        """Load the decision's adapter first (prod, not resident); a failed load falls back to the base."""
        from acelora.loading import ensure_adapter

        base_url = self.upstream.endpoint if decision.server is None and self.upstream else None
        decision = await ensure_adapter(skill, decision, self.client, base_url=base_url)
        if decision.server is None and self.upstream is not None and decision.resident and decision.adapter:
            self.upstream.resident.add(decision.adapter)
        return decision

    # -- OpenAI routes ------------------------------------------------------------------------
    async def proxy(self, request: Request) -> Response:
        body = await _json_body(request, self.max_body_bytes)
        if not isinstance(body, dict):
            return _bad_request("Request body must be a JSON object.")
        for field, kind, name in (("model", str, "a string"), ("stream", bool, "a boolean"),
                                  ("messages", list, "a list")):
            if field in body and not isinstance(body[field], kind):
                return _bad_request(f"'{field}' must be {name}.", field)
        scope = request.scope
        decision: Decision | None = scope.get(DECISION_KEY)
        suffix = scope["path"].removeprefix("/v1/")
        outcome = await self.proxy_for().send(decision, body, suffix, _tenant(scope), stream=True)
        _note(scope, decision, outcome)
        if outcome.error is not None:
            return outcome.error
        assert outcome.response is not None
        return relay(outcome.response, self.max_stream_s)

    async def execute(self, request: Request) -> Response:
        t0 = time.perf_counter_ns()
        try:
            ex = ExecuteRequest.model_validate(await _json_body(request, self.max_body_bytes))
        except ValidationError as e:
            return _bad_request(_validation_message(e))
        tenant = _tenant(request.scope)
        routing = {**ex.input.model_dump(), "stream": False, "extra_body": ex.extra_body}
        if ex.target.model is not None:
            routing["model"] = ex.target.model
        override = ex.skill_overrides.multi_lora.mode if ex.skill_overrides and ex.skill_overrides.multi_lora else None
        if override is not None and is_downgrade(Mode(override)) and not may_downgrade(self.skill, request.scope):
            return Response(downgrade_denied_body(), 403, media_type="application/json")
        req = RouteRequest.from_body(routing, request.headers, tenant=tenant)
        if override is not None:  # the body's skill_overrides win over the header
            req.mode = Mode(override)
        decision = self.skill.route(req)
        swap_ns = 0
        if decision.needs_load:
            t = time.perf_counter_ns()
            decision = await self.load(self.skill, decision)
            swap_ns = time.perf_counter_ns() - t
        overhead_ms = (time.perf_counter_ns() - t0 - swap_ns) / 1e6
        if decision.reject:
            extra = trace_headers(self.skill, decision, None, overhead_ms)
            return Response(not_found_body(requested_name(req)), 404, media_type="application/json",
                            headers={k.decode(): v.decode("latin-1") for k, v in extra})
        # Off/shadow send the body as the client meant it; acelora's own fields never leave the gateway.
        body = decision.apply(routing) if decision.mode is Mode.PROD else Decision(Mode.PROD).apply(routing)
        outcome, status, output = await self.proxy_for().call_json(decision, body, "chat/completions", tenant)
        decision = outcome.decision or decision
        served_by = outcome.server.name if outcome.server is not None else None
        event = self.skill.record(decision, served_by=served_by, overhead_ms=overhead_ms)
        hdrs = {k.decode(): v.decode("latin-1") for k, v in event_headers(event)}
        if status != 200:
            return JSONResponse(output, status, headers=hdrs)
        return JSONResponse({"output": output, "trace": [event.to_dict()] if event else []}, headers=hdrs)

    async def models(self, request: Request) -> Response:
        skill = self.skill
        bases = sorted({b for b in (skill.base_model, *skill.fleet.base_models()) if b})
        parent = bases[0] if bases else None

        def card(mid: str, parent: str | None) -> dict[str, Any]:
            return {"id": mid, "object": "model", "created": self.created, "owned_by": "acelora", "root": mid,
                    "parent": parent}

        data = [card(b, None) for b in bases]
        data += [card(s.name, s.base_model or parent)
                 for s in sorted(skill.registry.visible_to(_tenant(request.scope)), key=lambda s: s.name)]
        return JSONResponse({"object": "list", "data": data})

    # -- fleet admin --------------------------------------------------------------------------
    async def add_server(self, request: Request) -> Response:
        if not request.scope.get(ADMIN_KEY):
            return error_response(403, _FLEET_DENIED, "PermissionDeniedError")
        data = await _json_body(request, self.max_body_bytes)
        if isinstance(data, dict) and "api_key_env" in data:
            return _bad_request("api_key_env is not accepted here: declare servers that need a key in the config "
                                "file ([[servers]] api_key_env).", "api_key_env")
        try:
            spec = ServerIn.model_validate(data)
        except ValidationError as e:
            return _bad_request(_validation_message(e))
        if self.skill.fleet.get(spec.name) is not None:
            return error_response(409, f"A server named {spec.name!r} is already registered.", "ConflictError",
                                  "name")
        server = ModelServer(**spec.model_dump())
        from acelora.loading import probe_server

        try:
            await probe_server(server, self.client, timeout_s=min(10.0, self.timeout.read or 10.0))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return error_response(502, f"Server {server.name} could not be probed at its endpoint.", "BadGatewayError")
        self.skill.fleet.add(server)
        return JSONResponse(server.public_dict(), 201)

    async def list_fleet(self, request: Request) -> Response:
        if not request.scope.get(ADMIN_KEY):
            return error_response(403, _FLEET_DENIED, "PermissionDeniedError")
        return JSONResponse({"object": "list", "data": [s.public_dict() for s in self.skill.fleet.servers]})

    async def remove_server(self, request: Request) -> Response:
        if not request.scope.get(ADMIN_KEY):
            return error_response(403, _FLEET_DENIED, "PermissionDeniedError")
        name = request.path_params["name"]
        if self.skill.fleet.remove(name) is None:
            return error_response(404, f"No server named {name[:128]!r}.", "NotFoundError", "name")
        return JSONResponse({"id": name, "object": "server", "deleted": True})

    # -- operations ---------------------------------------------------------------------------
    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.skill.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "mode": self.skill.mode.value, "servers": len(self.skill.fleet)})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        for name, error in (await self.skill.fleet.probe(self.client)).items():
            if error is not None:
                log.warning("could not probe %s: %s", name, error.split(":")[0])
        try:
            yield
        finally:
            if self._own_client and self._client is not None:
                await self._client.aclose()
                self._client = None


def _note(scope: dict[str, Any], routed: Decision | None, outcome: Outcome) -> None:
    """Tell the middleware what finally happened (failover, reload, fallback): its trace headers read the scope."""
    if routed is not None and outcome.decision is not None and outcome.decision is not routed:
        scope[DECISION_KEY] = outcome.decision
        if isinstance(scope.get("state"), dict):
            scope["state"]["acelora"] = outcome.decision
    if outcome.server is not None:
        scope[SERVED_BY_KEY] = outcome.server.name


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "APIError")
    return error_response(exc.status_code, str(exc.detail), kind)


async def _acelora_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, BodyTooLarge):
        return error_response(413, str(exc), "BadRequestError")
    return _bad_request(str(exc))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "The gateway failed to handle this request.", "InternalServerError")


def create_gateway(skill: MultiLoRA, *, upstream: str | ModelServer | None = None, upstream_kind: str = "vllm",
                   timeout_s: float | None = None, connect_timeout_s: float = 5.0,
                   max_body_bytes: int | None = None, cache_salt_secret: bytes | str | None = None,
                   http_client: httpx.AsyncClient | None = None, max_stream_s: float | None = None) -> Starlette:
    """The OpenAI-compatible gateway as a Starlette app.

    >>> app = create_gateway(acelora.MultiLoRA.from_config("acelora.toml"))  # doctest: +SKIP
    >>> uvicorn.run(app, port=8080)  # doctest: +SKIP

    ``upstream``: where requests go when the decision names no fleet server (URL or ModelServer;
    defaults to ``[gateway] upstream`` of the skill's config). ``cache_salt_secret``: key of the
    per-tenant vLLM ``cache_salt`` (env ``ACELORA_CACHE_SALT_SECRET``; random per process otherwise).
    ``timeout_s`` bounds each upstream read; ``max_stream_s`` bounds a whole streamed answer.
    """
    gw_cfg = getattr(getattr(skill, "config", None), "gateway", None)
    if upstream is None and gw_cfg is not None:
        upstream = gw_cfg.upstream
    if isinstance(upstream, str):
        upstream = ModelServer(name="upstream", endpoint=upstream, kind=upstream_kind, base_model=skill.base_model)
    if timeout_s is None:
        timeout_s = gw_cfg.timeout_s if gw_cfg is not None else 120.0
    if max_body_bytes is None:
        max_body_bytes = gw_cfg.max_body_bytes if gw_cfg is not None else DEFAULT_MAX_BODY
    if max_stream_s is None:
        max_stream_s = gw_cfg.max_stream_s if gw_cfg is not None else DEFAULT_MAX_STREAM_S
    secret = cache_salt_secret or os.environ.get("ACELORA_CACHE_SALT_SECRET") or os.urandom(32)
    gw = Gateway(skill, upstream, httpx.Timeout(timeout_s, connect=connect_timeout_s),
                 secret.encode() if isinstance(secret, str) else secret, http_client, max_body_bytes)
    gw.max_stream_s = max_stream_s
    routes = [
        Route("/v1/chat/completions", gw.proxy, methods=["POST"]),
        Route("/v1/completions", gw.proxy, methods=["POST"]),
        Route("/v1/execute", gw.execute, methods=["POST"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/fleet", gw.list_fleet, methods=["GET"]),
        Route("/v1/fleet/servers", gw.add_server, methods=["POST"]),
        Route("/v1/fleet/servers/{name}", gw.remove_server, methods=["DELETE"]),
        Route("/metrics", gw.metrics, methods=["GET"]),
        Route("/healthz", gw.healthz, methods=["GET"]),
    ]
    middleware = [
        Middleware(GatewayAuth, skill=skill),
        Middleware(MultiLoRAMiddleware, skill=skill, max_body_bytes=max_body_bytes, loader=gw.load,
                   default_server=upstream),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=gw.lifespan,
                    exception_handlers={HTTPException: _http_error, AceloraError: _acelora_error,
                                        Exception: _internal_error})
    app.state.gateway = gw
    return app


def gateway_main(argv: Sequence[str] | None = None) -> int:
    """``acelora gateway --config acelora.toml [--host 127.0.0.1] [--port 8080] [--upstream URL]``.

    >>> gateway_main(["--config", "acelora.toml", "--port", "8080"])  # doctest: +SKIP
    """
    import uvicorn

    p = argparse.ArgumentParser(prog="acelora gateway", description="Run the OpenAI-compatible acelora gateway.")
    p.add_argument("--config", required=True, help="acelora TOML config")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--upstream", default=None, help="default upstream URL (overrides [gateway] upstream)")
    p.add_argument("--upstream-kind", choices=["vllm", "sglang", "openai"], default="vllm")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(list(argv) if argv is not None else None)
    skill = MultiLoRA.from_config(args.config)
    app = create_gateway(skill, upstream=args.upstream, upstream_kind=args.upstream_kind)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0

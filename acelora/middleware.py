"""``MultiLoRAMiddleware``: the multi-LoRA decision inside any Starlette/FastAPI service (pure ASGI).

The downstream app finds the applied :class:`~acelora.skill.Decision` in ``scope["acelora.decision"]``
(the contract; also ``request.state.acelora`` in Starlette, through ``scope["state"]``). It may replace
that decision (e.g. after a failed load) and set ``scope["acelora.served_by"]`` before it answers: the
trace headers are written from what the scope holds when the response starts. A skill in ``off`` mode
is not consulted (no body read, no decision in the scope) unless the request carries an
``x-ace-skill-override`` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from acelora import jsonbody
from acelora.errors import InvalidRequest
from acelora.fleet import ModelServer
from acelora.request import prefetch_hints
from acelora.skill import OVERRIDE_HEADER, TENANT_HEADER, Decision, Mode, MultiLoRA, RouteRequest
from acelora.trace import SERVED_BY_HEADER, TRACE_HEADER, TraceEvent, encode_header

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("acelora.middleware")

DEFAULT_PATHS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_MAX_BODY = 4 * 1024 * 1024
DECISION_KEY = "acelora.decision"
SERVED_BY_KEY = "acelora.served_by"
TENANT_KEY = "acelora.tenant"
_ACE_PREFIX = b"x-ace-"
_TRACE_PREFIX = b"x-ace-trace-"
_OUR_HEADERS = (TRACE_HEADER.encode(), SERVED_BY_HEADER.encode())
_OVERRIDE = OVERRIDE_HEADER.encode()
_TENANT = TENANT_HEADER.encode()
_JSON_HEADERS = [(b"content-type", b"application/json")]
_perf_ns = time.perf_counter_ns


def openai_error(status: int, message: str, type_: str, param: str | None = None,
                 code: str | int | None = None) -> bytes:
    """An error body in OpenAI's (and vLLM's) envelope.

    >>> openai_error(404, "The model `x` does not exist.", "NotFoundError", "model")[:9]
    b'{"error":'
    """
    return json.dumps({"error": {"message": message, "type": type_, "param": param,
                                 "code": status if code is None else code}}).encode()


def not_found_body(name: str | None) -> bytes:
    """vLLM's 404 for an unknown model; lists nothing, so a forbidden adapter looks exactly like an unknown one.

    >>> json.loads(not_found_body("med-qa-v1"))["error"]["message"]
    'The model `med-qa-v1` does not exist.'
    """
    shown = (name or "")[:128]
    return openai_error(404, f"The model `{shown}` does not exist.", "NotFoundError", "model")


def requested_name(req: RouteRequest) -> str | None:
    """The adapter name as the client asked for it (what a 404 may echo back).

    >>> requested_name(RouteRequest(model="tiny-llama", lora_name="code-python-v2"))
    'code-python-v2'
    """
    return req.lora_name if req.lora_name is not None else req.model


async def send_json(send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer a whole JSON response through a raw ASGI ``send``.

    >>> await send_json(send, 404, not_found_body("x"))  # doctest: +SKIP
    """
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def event_headers(event: TraceEvent | None) -> list[tuple[bytes, bytes]]:
    """The ``x-ace-trace-multi-lora`` / ``x-ace-served-by`` headers of a recorded event ([] for None).

    >>> event_headers(None)
    []
    """
    if event is None:
        return []
    out = [(_OUR_HEADERS[0], encode_header(event).encode("latin-1"))]
    if event.served_by:
        out.append((_OUR_HEADERS[1], event.served_by.encode("latin-1", "replace")))
    return out


def trace_headers(skill: MultiLoRA, decision: Decision, served_by: str | None,
                  overhead_ms: float | None) -> list[tuple[bytes, bytes]]:
    """Record ``decision`` and return its trace headers ([] when the skill was not consulted).

    >>> trace_headers(skill, skill.route(RouteRequest(model="code-python-v2")), "vllm-primary", 0.02)  # doctest: +SKIP
    """
    return event_headers(skill.record(decision, served_by=served_by, overhead_ms=overhead_ms))


Loader = Callable[[MultiLoRA, Decision], Awaitable[Decision]]


class MultiLoRAMiddleware:
    """Routes OpenAI-style POST bodies through ``skill`` and adds trace headers to the responses.

    >>> app = MultiLoRAMiddleware(app, skill=skill)                  # any ASGI app  # doctest: +SKIP
    >>> fastapi_app.add_middleware(MultiLoRAMiddleware, skill=skill)  # doctest: +SKIP

    ``tenant_from_header``: take the tenant from ``x-ace-tenant-id`` when no auth layer put one in
    ``scope["acelora.tenant"]``. ``loader``: awaited for prod decisions whose adapter must be loaded
    first (default: :func:`acelora.loading.ensure_adapter` with a shared, bounded httpx client).
    ``default_server``: where the app sends requests when the skill has no fleet; its ``resident`` set
    tells ``route()`` which adapters need no load.
    """

    def __init__(self, app: ASGIApp, skill: MultiLoRA, *, paths: Iterable[str] = DEFAULT_PATHS,
                 max_body_bytes: int = DEFAULT_MAX_BODY, tenant_from_header: bool = True,
                 served_by: str | None = None, loader: Loader | None = None, load_timeout_s: float = 60.0,
                 default_server: ModelServer | None = None) -> None:
        self.app = app
        self.skill = skill
        self.paths = frozenset(paths)
        self.max_body_bytes = max_body_bytes
        self.tenant_from_header = tenant_from_header
        self.served_by = served_by
        self.loader = loader or self._default_loader
        self._custom_loader = loader is not None
        self.load_timeout_s = load_timeout_s
        self.default_server = default_server
        self._http: Any = None
        self.background: set[asyncio.Task[Any]] = set()  # prefetch loads in flight (held so they finish)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        override = False
        for k, _ in headers:
            if k.startswith(_ACE_PREFIX):
                if k == _OVERRIDE:
                    override = True
                elif k.startswith(_TRACE_PREFIX):
                    # Clients must not forge traces for anything downstream to trust.
                    scope = dict(scope, headers=[(k, v) for k, v in headers if not k.startswith(_TRACE_PREFIX)])
        # Off means "not consulted": unless a request overrides the mode, its body is not even read.
        if (scope["method"] != "POST" or scope["path"] not in self.paths
                or (self.skill.mode is Mode.OFF and not override)):
            await self.app(scope, receive, send)
            return
        await MultiLoRAResponder(self, scope)(receive, send)

    async def _default_loader(self, skill: MultiLoRA, decision: Decision) -> Decision:
        import httpx

        from acelora.loading import ensure_adapter

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.load_timeout_s, connect=5.0))
        default = self.default_server if decision.server is None else None
        decision = await ensure_adapter(skill, decision, self._http, timeout_s=self.load_timeout_s,
                                        base_url=default.endpoint if default is not None else None)
        if default is not None and decision.resident and decision.adapter:
            default.resident.add(decision.adapter)
        return decision

    async def aclose(self) -> None:
        """Close the HTTP client used for adapter loads (if one was opened)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def _prefetch_done(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prefetch load failed: %r", task.exception())

    return done


class MultiLoRAResponder:
    """One request through the middleware: buffered body in, decision applied, trace headers out.

    >>> await MultiLoRAResponder(middleware, scope)(receive, send)  # doctest: +SKIP
    """

    __slots__ = ("mw", "scope", "body", "decision", "t0", "overhead_ms", "receive")

    def __init__(self, mw: MultiLoRAMiddleware, scope: Scope) -> None:
        self.mw = mw
        self.scope = scope
        self.t0 = _perf_ns()
        self.body: bytes | None = b""
        self.decision: Decision | None = None
        self.overhead_ms: float | None = None

    async def __call__(self, receive: Receive, send: Send) -> None:
        mw = self.mw
        self.receive = receive
        body = await self._read_body(receive)
        if body is None:
            await send_json(send, 413, openai_error(
                413, f"Request body is larger than {mw.max_body_bytes} bytes.", "BadRequestError"))
            return
        try:
            payload = jsonbody.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            await send_json(send, 400, openai_error(400, "Request body is not valid JSON.", "BadRequestError"))
            return
        if not isinstance(payload, dict):  # every OpenAI route this middleware routes takes a JSON object
            await send_json(send, 400, openai_error(400, "Request body must be a JSON object.", "BadRequestError"))
            return
        tenant = self.scope.get(TENANT_KEY)
        hdrs = {}
        for k, v in self.scope["headers"]:
            if k == _OVERRIDE or (k == _TENANT and tenant is None and mw.tenant_from_header):
                hdrs[k.decode()] = v.decode("latin-1")
        try:
            req = RouteRequest.from_body(payload, hdrs, tenant=tenant)
        except InvalidRequest as e:
            await send_json(send, 400, openai_error(400, str(e), "BadRequestError", OVERRIDE_HEADER))
            return
        default = mw.default_server
        if default is not None and not len(mw.skill.fleet):
            name = req.lora_name or req.model
            req.resident = name in default.resident if name else None
        decision = mw.skill.route(req)
        if decision.mode is Mode.PROD and ("lora_prefetch" in payload or "extra_body" in payload):
            self.prefetch(req, prefetch_hints(payload)[: mw.skill.max_prefetch_hints])
        swap_ns = 0
        if decision.needs_load and (decision.server is not None or default is not None or mw._custom_loader):
            t = _perf_ns()
            decision = await mw.loader(mw.skill, decision)
            swap_ns = _perf_ns() - t
        elif decision.needs_load and decision.adapter:
            # Nothing here can load it: the app behind us does, on this request's path (a wait we do not
            # see, so no swap_ms). Later requests find it resident there, as far as we can know.
            mw.skill.resident.add(decision.adapter)
        if decision.reject:
            extra = trace_headers(mw.skill, decision, None, (_perf_ns() - self.t0 - swap_ns) / 1e6)
            await send_json(send, 404, not_found_body(requested_name(req)), extra)
            return
        out = decision.apply(payload)
        scope = self.scope
        if out is not payload:
            body = jsonbody.dumps(out)
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())])
        else:
            scope = dict(scope)
        scope[DECISION_KEY] = decision
        if isinstance(scope.get("state"), dict):  # shared with the server and outer middleware: add to it
            scope["state"]["acelora"] = decision
        else:
            scope["state"] = {"acelora": decision}
        self.scope, self.body, self.decision = scope, body, decision
        self.overhead_ms = (_perf_ns() - self.t0 - swap_ns) / 1e6
        await mw.app(scope, self.receive_body, self.make_send(send))

    def prefetch(self, req: RouteRequest, names: list[str]) -> None:
        """Start loading, in the background, the adapters this request says later ones will need
        (``lora_prefetch``). Each goes through route() with the request's tenant, so a hint can only
        warm an adapter that tenant could use; nothing is recorded as a request."""
        mw = self.mw
        default = mw.default_server
        for name in names:
            hint = RouteRequest(model=req.model, lora_name=name, tenant=req.tenant, mode=Mode.PROD)
            if default is not None and not len(mw.skill.fleet):
                hint.resident = name in default.resident
            d = mw.skill.route(hint)
            if d.needs_load and (d.server is not None or default is not None or mw._custom_loader):
                task = asyncio.get_running_loop().create_task(mw.loader(mw.skill, d))
                mw.background.add(task)
                task.add_done_callback(_prefetch_done(mw.background))

    async def _read_body(self, receive: Receive) -> bytes | None:
        limit = self.mw.max_body_bytes
        for k, v in self.scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                return None
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was complete
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def receive_body(self) -> Message:
        if self.body is None:  # the body was delivered: later calls wait for the disconnect
            return await self.receive()
        body, self.body = self.body, None
        return {"type": "http.request", "body": body, "more_body": False}

    def make_send(self, send: Send) -> Send:
        async def send_with_trace(message: Message) -> None:
            if message["type"] == "http.response.start":
                scope = self.scope
                decision = scope.get(DECISION_KEY, self.decision)
                extra = trace_headers(self.mw.skill, decision, scope.get(SERVED_BY_KEY, self.mw.served_by),
                                      self.overhead_ms)
                if extra:
                    # Don't send the app's (or an upstream's) trace next to ours: ours describes this hop.
                    headers = [(k, v) for k, v in message.get("headers", ()) if k not in _OUR_HEADERS]
                    message = {**message, "headers": headers + extra}
            await send(message)

        return send_with_trace

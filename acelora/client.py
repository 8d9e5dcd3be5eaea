"""``wrap_openai``: an unmodified OpenAI SDK client made adapter-aware by an httpx transport.

The transport sits under the SDK's own HTTP client, so streaming, retries, timeouts, ``with_raw_response``
and every endpoint keep working; it only sees one request and returns one response. Works with SDKs on
``httpx`` and on ``httpx2`` (requests and responses are built with the library the request came from).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from acelora import jsonbody
from acelora.errors import InvalidRequest
from acelora.middleware import not_found_body, openai_error, requested_name
from acelora.skill import OVERRIDE_HEADER, Decision, Mode, MultiLoRA, RouteRequest
from acelora.trace import SERVED_BY_HEADER, TRACE_HEADER, encode_header

DEFAULT_PATHS = ("chat/completions", "completions")
_perf_ns = time.perf_counter_ns
C = TypeVar("C")


@dataclass(slots=True)
class _Plan:
    """One routed request: what to send (``request``) or what to answer at once (``response``)."""

    decision: Decision
    request: Any = None
    response: Any = None
    overhead_ms: float = 0.0
    served_by: str | None = None  # the fleet server it was sent to; None when it went to the client's base_url


def _lib(obj: object) -> Any:
    """The HTTP library (``httpx`` or ``httpx2``) that ``obj`` belongs to."""
    return sys.modules[type(obj).__module__.partition(".")[0]]


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: Any) -> tuple[str, str, int | None]:
    """Scheme, host and port (default ports filled in): a key is only for the origin it was given for."""
    return url.scheme, url.host, url.port or _DEFAULT_PORTS.get(url.scheme)


def _bad_body(request: Any, message: str) -> Any:
    return _lib(request).Response(400, headers={"content-type": "application/json"}, request=request,
                                  content=openai_error(400, message, "BadRequestError"))


class _Router:
    """What the sync and async transports share: matching, routing, rewriting, trace headers."""

    def __init__(self, skill: MultiLoRA, tenant: str | None, base_url: str, paths: tuple[str, ...],
                 load_timeout_s: float) -> None:
        self.skill = skill
        self.tenant = tenant
        self.base_url = base_url.rstrip("/")
        self.base_path = httpx.URL(base_url).path.rstrip("/") + "/"
        self.paths = frozenset(paths)
        self.load_timeout_s = load_timeout_s

    def match(self, request: Any) -> tuple[RouteRequest, dict[str, Any], str] | Any | None:
        """(route request, body, path suffix) for a routed call; a ready error response; or None to pass it."""
        if request.method != "POST":
            return None
        path = request.url.path
        if not path.startswith(self.base_path) or path[len(self.base_path):] not in self.paths:
            return None
        try:
            content = request.content
        except Exception:  # a streamed body (not read yet) is not ours to route
            return None
        try:
            payload = jsonbody.loads(content)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            return _bad_body(request, "Request body is not valid JSON.")
        if not isinstance(payload, dict):
            return _bad_body(request, "Request body must be a JSON object.")
        try:
            req = RouteRequest.from_body(payload, request.headers, tenant=self.tenant)
        except InvalidRequest as e:
            return _lib(request).Response(400, headers={"content-type": "application/json"}, request=request,
                                          content=openai_error(400, str(e), "BadRequestError", OVERRIDE_HEADER))
        return req, payload, path[len(self.base_path):]

    def build(self, request: Any, req: RouteRequest, payload: dict[str, Any], suffix: str, decision: Decision,
              t0: int, swap_ns: int) -> _Plan:
        lib = _lib(request)
        plan = _Plan(decision)
        if decision.reject:
            plan.overhead_ms = (_perf_ns() - t0 - swap_ns) / 1e6
            plan.response = lib.Response(404, headers={"content-type": "application/json"}, request=request,
                                         content=not_found_body(requested_name(req)))
            self.finish(plan, plan.response)
            return plan
        out = decision.apply(payload)
        server = decision.server if decision.mode is Mode.PROD else None  # off/shadow: the client's base_url
        if out is payload and server is None:
            plan.request = request  # untouched
        else:  # prod, or shadow keeping another tenant's adapter from running (apply() set the base model)
            headers = request.headers.copy()
            for name in ("host", "content-length"):
                headers.pop(name, None)
            url = request.url
            if server is not None:
                url = lib.URL(f"{server.openai_base_url}/{suffix}").copy_with(query=request.url.query or None)
                plan.served_by = server.name
                key = server.api_key
                if key:
                    headers["authorization"] = f"Bearer {key}"
                elif _origin(url) != _origin(request.url):
                    headers.pop("authorization", None)  # the client's key was meant for its own base_url
            content = request.content if out is payload else jsonbody.dumps(out)
            plan.request = lib.Request(request.method, url, headers=headers, content=content,
                                       extensions=request.extensions)
        plan.overhead_ms = (_perf_ns() - t0 - swap_ns) / 1e6
        return plan

    def finish(self, plan: _Plan, response: Any) -> Any:
        served_by = plan.served_by or (plan.request or response.request).url.host
        event = self.skill.record(plan.decision, served_by=served_by, overhead_ms=plan.overhead_ms)
        if event is not None:
            response.headers[TRACE_HEADER] = encode_header(event)
            if event.served_by:
                response.headers[SERVED_BY_HEADER] = event.served_by
        return response


class AceloraTransport(httpx.BaseTransport):
    """Sync transport: routes OpenAI calls through ``skill`` before the wrapped transport sends them.

    >>> t = AceloraTransport(httpx.HTTPTransport(), skill, base_url="http://127.0.0.1:8000/v1")  # doctest: +SKIP
    >>> httpx.Client(transport=t)  # doctest: +SKIP
    """

    def __init__(self, inner: Any, skill: MultiLoRA, *, base_url: str, tenant: str | None = None,
                 paths: tuple[str, ...] = DEFAULT_PATHS, load_timeout_s: float = 60.0) -> None:
        self.inner = inner
        self.router = _Router(skill, tenant, base_url, paths, load_timeout_s)
        self._load_client: httpx.Client | None = None

    def handle_request(self, request: Any) -> Any:
        t0 = _perf_ns()
        matched = self.router.match(request)
        if matched is None:
            return self.inner.handle_request(request)
        if not isinstance(matched, tuple):
            return matched
        req, payload, suffix = matched
        router = self.router
        decision = router.skill.route(req)
        swap_ns = 0
        if decision.needs_load:
            from acelora.loading import ensure_adapter_sync

            if self._load_client is None:
                self._load_client = httpx.Client(timeout=httpx.Timeout(router.load_timeout_s, connect=5.0))
            t = _perf_ns()
            decision = ensure_adapter_sync(router.skill, decision, self._load_client, base_url=router.base_url,
                                           timeout_s=router.load_timeout_s)
            swap_ns = _perf_ns() - t
        plan = router.build(request, req, payload, suffix, decision, t0, swap_ns)
        if plan.response is not None:
            return plan.response
        return router.finish(plan, self.inner.handle_request(plan.request))

    def close(self) -> None:
        if self._load_client is not None:
            self._load_client.close()
        self.inner.close()


class AsyncAceloraTransport(httpx.AsyncBaseTransport):
    """Async twin of :class:`AceloraTransport` (adapter loads are awaited, single-flight).

    >>> t = AsyncAceloraTransport(httpx.AsyncHTTPTransport(), skill, base_url="http://h/v1")  # doctest: +SKIP
    >>> httpx.AsyncClient(transport=t)  # doctest: +SKIP
    """

    def __init__(self, inner: Any, skill: MultiLoRA, *, base_url: str, tenant: str | None = None,
                 paths: tuple[str, ...] = DEFAULT_PATHS, load_timeout_s: float = 60.0) -> None:
        self.inner = inner
        self.router = _Router(skill, tenant, base_url, paths, load_timeout_s)
        self._load_client: httpx.AsyncClient | None = None

    async def handle_async_request(self, request: Any) -> Any:
        t0 = _perf_ns()
        matched = self.router.match(request)
        if matched is None:
            return await self.inner.handle_async_request(request)
        if not isinstance(matched, tuple):
            return matched
        req, payload, suffix = matched
        router = self.router
        decision = router.skill.route(req)
        swap_ns = 0
        if decision.needs_load:
            from acelora.loading import ensure_adapter

            if self._load_client is None:
                self._load_client = httpx.AsyncClient(timeout=httpx.Timeout(router.load_timeout_s, connect=5.0))
            t = _perf_ns()
            decision = await ensure_adapter(router.skill, decision, self._load_client, base_url=router.base_url,
                                            timeout_s=router.load_timeout_s)
            swap_ns = _perf_ns() - t
        plan = router.build(request, req, payload, suffix, decision, t0, swap_ns)
        if plan.response is not None:
            return plan.response
        return router.finish(plan, await self.inner.handle_async_request(plan.request))

    async def aclose(self) -> None:
        if self._load_client is not None:
            await self._load_client.aclose()
        await self.inner.aclose()


def _rewrap(http_client: Any, wrap: Any) -> Any:
    """A client of the same class and settings as ``http_client`` whose transports are wrapped by ``wrap``."""
    mounts = {p.pattern: (wrap(t) if t is not None else None) for p, t in http_client._mounts.items()}
    return type(http_client)(
        transport=wrap(http_client._transport), mounts=mounts, timeout=http_client.timeout,
        follow_redirects=http_client.follow_redirects, max_redirects=http_client.max_redirects,
        event_hooks=http_client.event_hooks, headers=http_client.headers, cookies=http_client.cookies,
        auth=http_client.auth, base_url=http_client.base_url, trust_env=http_client.trust_env,
    )


def wrap_openai(client: C, skill: MultiLoRA, tenant: str | None = None, *,
                paths: tuple[str, ...] = DEFAULT_PATHS, load_timeout_s: float = 60.0) -> C:
    """A copy of an ``openai.OpenAI`` / ``AsyncOpenAI`` client whose requests go through ``skill``.

    >>> client = wrap_openai(openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x"), skill)  # doctest: +SKIP
    >>> client.chat.completions.create(model="base", messages=m, extra_body={"lora_name": "code-python-v2"})  # doctest: +SKIP

    In prod with a fleet, routed calls go to the chosen server (its API key replaces the client's when
    configured; the client's own key is only kept for a server of the same scheme, host and port); otherwise,
    and always in off/shadow mode, to the client's own ``base_url`` untouched. The original client is left as it was; both share the
    connection pool, so closing either closes it.
    """
    http_client = getattr(client, "_client", None)
    if http_client is None or not hasattr(client, "with_options"):
        raise TypeError(f"wrap_openai() needs an openai.OpenAI or openai.AsyncOpenAI client, got {type(client)!r}")
    base_url = str(client.base_url)  # type: ignore[attr-defined]
    opts = dict(skill=skill, base_url=base_url, tenant=tenant, paths=paths, load_timeout_s=load_timeout_s)
    is_async = hasattr(http_client, "aclose")
    cls = AsyncAceloraTransport if is_async else AceloraTransport
    wrapped = _rewrap(http_client, lambda inner: cls(inner, **opts))
    return client.with_options(http_client=wrapped)  # type: ignore[attr-defined,no-any-return]

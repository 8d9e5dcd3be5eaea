"""An HTTP server for the embedded engine that speaks vLLM 0.33's OpenAI dialect exactly.

Routes: ``/v1/chat/completions``, ``/v1/completions`` (JSON and SSE), ``/v1/models``, ``/health``,
``/metrics`` (Prometheus, incl. ``vllm:lora_requests_info``), and — only with runtime updating on —
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. ``/acelora/info`` adds what vLLM does not
expose (base weight bytes, pool stats). ``acelora serve`` / ``python -m acelora_kernels.server``
start it; see :func:`serve_main`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from acelora.errors import AdapterNotFound
from acelora.names import is_valid_adapter_name
from acelora_kernels import vllm_wire as wire
from acelora_kernels.engine import AdapterFailed, Engine, SamplingParams
from acelora_kernels.server_lora import RuntimeLoraRoutes

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_from_env() -> bool:
    """vLLM's switch: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to 1/true.

    >>> runtime_lora_from_env() in (True, False)
    True
    """
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in {"1", "true", "yes"}


class EngineServer(RuntimeLoraRoutes):
    """The state behind the app: the engine, the served names, limits and the metrics registry.

    >>> app = create_app(engine, served_model_name="acelora/tiny-llama")  # doctest: +SKIP
    >>> app.state.server.engine is engine  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        engine: Engine,
        served_model_name: str,
        *,
        model_root: str | None = None,
        allow_runtime_lora: bool | None = None,
        adapter_roots: Sequence[str | os.PathLike[str]] = (),
        max_lora_rank: int = 64,
        max_loras: int | None = None,
        max_tokens_cap: int = 1024,
        max_body_bytes: int = 1 << 20,
        request_timeout_s: float = 300.0,
        base_weight_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        self.name = served_model_name
        self.model_root = model_root or served_model_name
        self.allow_runtime_lora = (
            runtime_lora_from_env() if allow_runtime_lora is None else allow_runtime_lora
        )
        self.roots = [Path(r).resolve() for r in adapter_roots]
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras if max_loras is not None else engine.max_loras
        self.max_tokens_cap = max_tokens_cap
        self.max_body_bytes = max_body_bytes
        self.timeout = request_timeout_s
        self.base_weight_bytes = base_weight_bytes
        self.fingerprint = f"acelora-engine-{abs(hash((served_model_name, id(engine)))) % 16**8:08x}"
        self.sent_paths = {n: str(engine.adapter_path(n)) for n in engine.adapter_names()}
        self._admin = asyncio.Lock()
        self._inflight: Counter[str] = Counter()
        self.registry = CollectorRegistry()
        self._lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
        )
        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            ["model_name"],
            registry=self.registry,
        )
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            ["model_name"],
            registry=self.registry,
        )
        self._prompt_tokens = PromCounter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            ["model_name"],
            registry=self.registry,
        )
        self._gen_tokens = PromCounter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            ["model_name"],
            registry=self.registry,
        )
        self._success = PromCounter("vllm:request_success", "Count of successfully processed requests.",
                                    ["model_name", "finished_reason"], registry=self.registry)  # fmt: skip
        self._refresh_lora_info()

    # -- helpers -------------------------------------------------------------------------------

    async def read_json(self, request: Request) -> Any:
        """The JSON body, bounded by ``max_body_bytes``; a :class:`Response` when it is unusable."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return wire.error(
                400, "Expected a JSON body with content-type: application/json.", "BadRequestError"
            )
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return wire.error(
                    413, f"Request body exceeds {self.max_body_bytes} bytes.", "BadRequestError"
                )
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            return wire.error(400, f"Invalid JSON body: {e}", "BadRequestError")
        except RecursionError:  # nesting deeper than the parser's recursion limit, under the size cap
            return wire.error(400, "Invalid JSON body: nested too deeply.", "BadRequestError")

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        """The body validated as ``model``, or the 400/413 :class:`Response` to send instead."""
        body = await self.read_json(request)
        if isinstance(body, Response):
            return body
        try:
            return model.model_validate(body)
        except ValidationError as e:
            return wire.validation_error(e)

    def target(self, model: str | None) -> tuple[str | None, str] | Response:
        """``(adapter or None, name to echo)`` for a request's ``model``, or vLLM's 404."""
        if model is None or model == self.name:
            return None, self.name
        if is_valid_adapter_name(model) and self.engine.adapter_path(model) is not None:
            return model, model
        return self.unknown_model(model)

    def unknown_model(self, model: str) -> Response:
        """vLLM's 404 for a name that is neither the base model nor a loaded adapter."""
        shown = model if len(model) <= 256 else model[:256] + "..."
        return wire.error(404, f"The model `{shown}` does not exist. Valid aliases: {self.name}.", "NotFoundError",
                          "model")  # fmt: skip

    def params(
        self, req: wire._Sampling, prompt_len: int, max_tokens: int | None
    ) -> SamplingParams | Response:
        """Sampling parameters for a request, bounded by the context and ``max_tokens_cap`` (or a 400)."""
        room = self.engine.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > self.max_tokens_cap:
            return wire.error(400, f"max_tokens must be at most {self.max_tokens_cap}.", "BadRequestError",
                              "max_tokens")  # fmt: skip
        want = max_tokens if max_tokens is not None else min(self.max_tokens_cap, room)
        if want > room or room < 1:
            return wire.error(
                400,
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested {prompt_len + want} tokens ({prompt_len} in the messages, {want} in the completion). "
                "Please reduce the length of the messages or completion.",
                "BadRequestError",
            )
        return SamplingParams(
            max_tokens=want,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=req.stop_list(),
        )

    def prefetch_hint(self, hint: Any) -> None:
        """Start loading the registered adapters a ``lora_prefetch`` hint names; ignore anything else.

        Only names already registered count (never paths, never names a resolver would look up);
        unknown names, other types and disabled adapters are ignored silently, as vLLM ignores
        fields it does not know.
        """
        names = [hint] if isinstance(hint, str) else hint if isinstance(hint, list) else []
        known = set(self.engine.adapter_names()) - set(self.engine.failed_adapters())
        for n in names[:16]:
            if isinstance(n, str) and n in known:
                try:
                    self.engine.prefetch(n)
                except Exception:  # a hint is best effort: the request itself goes on
                    continue

    def _refresh_lora_info(self) -> None:
        names = ",".join(sorted(n for n, c in self._inflight.items() if c > 0))
        self._lora_info.labels(str(self.max_loras or 0), names, names).set_to_current_time()

    def begin(self, adapter: str | None, prompt_tokens: int) -> None:
        """Count a request in: tokens and the in-flight adapters behind ``vllm:lora_requests_info``."""
        self._prompt_tokens.labels(self.name).inc(prompt_tokens)
        if adapter is not None:
            self._inflight[adapter] += 1
            self._refresh_lora_info()

    def end(self, adapter: str | None, completion_tokens: int, finish: str | None) -> None:
        """Count a request out (its generated tokens and finish reason)."""
        self._gen_tokens.labels(self.name).inc(completion_tokens)
        if finish in ("stop", "length"):
            self._success.labels(self.name, finish).inc()
        if adapter is not None:
            self._inflight[adapter] -= 1
            if self._inflight[adapter] <= 0:
                del self._inflight[adapter]
            self._refresh_lora_info()

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` and ``POST /v1/completions``, JSON or SSE."""
        chat = request.url.path.endswith("/chat/completions")
        req = await self.parse(request, wire.ChatCompletionRequest if chat else wire.CompletionRequest)
        if isinstance(req, Response):
            return req
        target = self.target(req.model)
        if isinstance(target, Response):
            return target
        adapter, echo = target
        if chat:
            ids = self.engine.encode_chat([{"role": m.role, "content": m.text()} for m in req.messages])
            max_tokens = req.max_completion_tokens or req.max_tokens
        else:
            p = req.prompt
            ids = list(p) if isinstance(p, list) and isinstance(p[0], int) else self.engine.encode(
                p if isinstance(p, str) else p[0])  # fmt: skip
            max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's completions default
            if any(t < 0 or t >= self.engine.vocab_size for t in ids):
                return wire.error(
                    400, "prompt token ids are outside the vocabulary.", "BadRequestError", "prompt"
                )
        params = self.params(req, len(ids), max_tokens)
        if isinstance(params, Response):
            return params
        self.prefetch_hint(req.lora_prefetch)
        rid = wire.request_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            writer = wire.ChunkWriter(
                "chat" if chat else "text", rid, echo, self.fingerprint, req.include_usage()
            )
            return StreamingResponse(
                self._stream(writer, ids, adapter, params), media_type="text/event-stream"
            )
        self.begin(adapter, len(ids))
        result = None
        try:
            async with asyncio.timeout(self.timeout):
                result = await _unless_disconnected(request, self.engine.generate(ids, adapter, params))
            if result is None:  # the client left: its generation was cancelled, nobody reads an answer
                return Response(status_code=499)
        except AdapterNotFound:  # unloaded while the request waited: the same 404 as an unknown name
            return self.unknown_model(adapter or "")
        except TimeoutError:
            return wire.error(504, f"Generation timed out after {self.timeout:g}s.", "TimeoutError")
        except AdapterFailed as e:  # this adapter broke the batch: only its requests fail
            return wire.error(500, wire.redact(str(e)), "InternalServerError")
        except Exception as e:  # answered here: the app-level handler re-raises, which drops the connection
            return wire.error(500, wire.redact(f"{type(e).__name__}: {e}"), "InternalServerError")
        finally:
            self.end(
                adapter, result.completion_tokens if result else 0, result.finish_reason if result else None
            )
        build = wire.chat_response if chat else wire.completion_response
        body = build(rid, echo, result.text, result.finish_reason, result.stop_reason, result.prompt_tokens,
                     result.completion_tokens, self.fingerprint)  # fmt: skip
        t = result.timings
        timings = (f"queue_ms={t.queue_ms:.1f},adapter_ms={t.adapter_ms:.1f},prefill_ms={t.prefill_ms:.1f},"
                   f"decode_ms={t.decode_ms:.1f},cold_load={int(t.adapter_cold_load)}")  # fmt: skip
        return JSONResponse(body, headers={"x-acelora-timings": timings})

    async def _stream(
        self, w: wire.ChunkWriter, ids: list[int], adapter: str | None, params: SamplingParams
    ) -> AsyncIterator[bytes]:
        self.begin(adapter, len(ids))
        result = None
        try:
            if w.kind == "chat":
                yield w.role()
            async with asyncio.timeout(self.timeout):
                async for ev in self.engine.stream(ids, adapter, params):
                    if ev.result is not None:
                        result = ev.result
                        yield w.finish(ev.text, result.finish_reason, result.stop_reason)
                    elif ev.text:
                        yield w.content(ev.text)
            if w.include_usage and result is not None:
                yield w.usage(result.prompt_tokens, result.completion_tokens)
        except Exception as e:  # the status line is gone: report in-band, as vLLM does
            kind, code = (
                ("TimeoutError", 504) if isinstance(e, TimeoutError) else ("InternalServerError", 500)
            )
            yield wire.sse({"error": {"message": wire.redact(str(e) or kind), "type": kind, "param": None,
                                      "code": code}})  # fmt: skip
        finally:
            self.end(
                adapter, result.completion_tokens if result else 0, result.finish_reason if result else None
            )
        yield wire.sse("[DONE]")

    # -- models, health, metrics ---------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the base card, then one card per adapter in load order."""
        cards = [wire.model_card(self.name, self.model_root, None, self.engine.max_model_len)]
        cards += [wire.model_card(n, self.sent_paths.get(n) or str(self.engine.adapter_path(n)), self.name, None)
                  for n in self.engine.adapter_names()]  # fmt: skip
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 with an empty body."""
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics``: this app's Prometheus registry."""
        snap = self.engine.snapshot()
        self._running.labels(self.name).set(snap["num_running"])
        self._waiting.labels(self.name).set(snap["num_waiting"])
        return Response(generate_latest(self.registry), headers={"content-type": CONTENT_TYPE_LATEST})

    async def info(self, request: Request) -> Response:
        """``GET /acelora/info``: what vLLM does not expose (base weight bytes, pool, limits)."""
        return JSONResponse({
            "engine": "acelora", "base_model": self.name, "root": self.model_root,
            "base_weight_bytes": self.base_weight_bytes, "max_model_len": self.engine.max_model_len,
            "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
            "runtime_lora_updating": self.allow_runtime_lora, "adapters": self.engine.adapter_names(),
            "pool": self.engine.pool.stats(),
        })  # fmt: skip


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``, but cancel it (and return None) as soon as the client disconnects: a client that
    gave up must not keep a batch slot generating up to max_tokens (vLLM does the same)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watch.cancel()
    return task.result() if not task.cancelled() else None


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return wire.error(500, wire.redact(f"{type(exc).__name__}: {exc}"), "InternalServerError")


def create_app(engine: Engine, served_model_name: str = "acelora/tiny-llama", **options: Any) -> Starlette:
    """The vLLM-dialect Starlette app over ``engine``; ``options`` go to :class:`EngineServer`.

    >>> app = create_app(engine, "acelora/tiny-llama", allow_runtime_lora=True, adapter_roots=["/adapters"])  # doctest: +SKIP
    >>> uvicorn.run(app, port=8000)  # doctest: +SKIP
    """
    server = EngineServer(engine, served_model_name, **options)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/chat/completions", server.generate, methods=["POST"]),
        Route("/v1/completions", server.generate, methods=["POST"]),
        Route("/acelora/info", server.info, methods=["GET"]),
    ]
    if server.allow_runtime_lora:
        routes += [
            Route("/v1/load_lora_adapter", server.load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", server.unload_adapter, methods=["POST"]),
        ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = server
    return app


def serve_main(argv: list[str] | None = None) -> int:
    """``acelora serve``: the tiny model + demo adapters by default, or ``--model``/``--adapters``.

    >>> serve_main(["--port", "8000"])  # doctest: +SKIP
    """
    from acelora_kernels.serve_cli import main

    return main(argv)


if __name__ == "__main__":
    raise SystemExit(serve_main())

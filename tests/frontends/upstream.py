"""A minimal upstream that follows vLLM 0.33's dialect (REFERENCE.md, shared/wire/) and remembers what it got.

It echoes the requested ``model`` (adapter or base), answers 404 in vLLM's envelope for unknown models,
streams SSE ending in ``data: [DONE]``, loads adapters at runtime (plain-text success, 400 duplicate,
500 for names in ``fail_loads``) and can fail the next N completions with 503 to exercise retries.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from acelora.registry import AdapterRegistry, AdapterSpec
from acelora.serving import BackgroundServer


@dataclass
class UpstreamState:
    base_model: str = "tiny-llama"
    adapters: set[str] = field(default_factory=set)
    runtime_loading: bool = True
    fail_loads: set[str] = field(default_factory=set)
    fail_next: int = 0
    delay_s: float = 0.0
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)

    def reset(self, **kw: Any) -> None:
        self.__init__(**kw)  # type: ignore[misc]


def _not_found(model: str, base: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"The model `{model}` does not exist. Valid aliases: {base}.",
                                   "type": "NotFoundError", "param": "model", "code": 404}}, 404)


def create_upstream(state: UpstreamState) -> Starlette:
    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        state.received.append(body)
        state.headers.append(dict(request.headers))
        if state.delay_s:
            await asyncio.sleep(state.delay_s)
        if state.fail_next > 0:
            state.fail_next -= 1
            return JSONResponse({"error": {"message": "overloaded", "type": "ServiceUnavailableError",
                                           "param": None, "code": 503}}, 503)
        model = body.get("model")
        if model != state.base_model and model not in state.adapters:
            return _not_found(str(model), state.base_model)
        chat = request.url.path.endswith("chat/completions")
        text = f"[{model}] hello"
        if body.get("stream"):
            async def events():
                kind = "chat.completion.chunk" if chat else "text_completion"
                for piece in ("[", f"{model}]", " hello"):
                    choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    yield "data: " + json.dumps({"id": "cmpl-1", "object": kind, "created": 1, "model": model,
                                                 "choices": [{**choice, "finish_reason": None}]}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream; charset=utf-8")
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "stop"} if chat else
                                  {"index": 0, "text": text, "finish_reason": "stop"})
        return JSONResponse({"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": model, "choices": [choice],
                             "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}})

    async def models(request: Request) -> Response:
        cards = [{"id": state.base_model, "object": "model", "owned_by": "vllm", "root": state.base_model,
                  "parent": None}]
        cards += [{"id": a, "object": "model", "owned_by": "vllm", "root": f"/adapters/{a}",
                   "parent": state.base_model} for a in sorted(state.adapters)]
        return JSONResponse({"object": "list", "data": cards})

    async def load(request: Request) -> Response:
        if not state.runtime_loading:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = json.loads(await request.body())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return JSONResponse({"error": {"message": "Both 'lora_name' and 'lora_path' must be provided.",
                                           "type": "BadRequestError", "param": None, "code": 400}}, 400)
        state.loads.append(body)
        if name in state.fail_loads:
            return JSONResponse({"error": {"message": "incompatible adapter", "type": "InternalServerError",
                                           "param": None, "code": 500}}, 500)
        if name in state.adapters:
            return JSONResponse({"error": {"message": f"The lora adapter '{name}' has already been loaded.",
                                           "type": "BadRequestError", "param": None, "code": 400}}, 400)
        state.adapters.add(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    return Starlette(routes=[
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
    ])


class ServerThread(BackgroundServer):
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a daemon thread; ``url`` once entered."""


BASE = "tiny-llama"
MIB = 2**20


def make_registry() -> AdapterRegistry:
    """code-python-v2 (public), med-qa-v1 (tenant_med only), and one adapter per incompatibility."""
    return AdapterRegistry([
        AdapterSpec(name="code-python-v2", path="/adapters/code-python-v2", base_model=BASE, rank=8,
                    size_bytes=2 * MIB),
        AdapterSpec(name="med-qa-v1", path="/adapters/med-qa-v1", base_model=BASE, rank=8, size_bytes=MIB,
                    tenants=frozenset({"tenant_med"})),
        AdapterSpec(name="legal-compliance-v1", path="/adapters/legal-compliance-v1", base_model=BASE, rank=16),
        AdapterSpec(name="mistral-helper", path="/adapters/mistral-helper", base_model="mistral-7b", rank=8),
        AdapterSpec(name="big-rank-v1", path="/adapters/big-rank-v1", base_model=BASE, rank=64),
        AdapterSpec(name="dora-v1", path="/adapters/dora-v1", base_model=BASE, rank=8, use_dora=True),
        AdapterSpec(name="broken-v1", path="/adapters/broken-v1", base_model=BASE, rank=8),
    ])

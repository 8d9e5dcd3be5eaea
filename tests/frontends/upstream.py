"""A minimal upstream that follows vLLM 0.33's dialect (REFERENCE.md, shared/wire/) and remembers what it got.

It echoes the requested ``model`` (adapter or base), answers 404 in vLLM's envelope for unknown models,
streams SSE ending in ``data: [DONE]``, loads adapters at runtime (plain-text success, 400 duplicate,
500 for names in ``fail_loads``) and can fail the next N completions with 503 to exercise retries.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


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


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a daemon thread; ``url`` once started."""

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="auto")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start within 20 s")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

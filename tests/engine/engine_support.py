"""Helpers of the engine tests (importable by name: ``conftest`` is ambiguous across test folders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from acelora.serving import BackgroundServer
from acelora_kernels.demo_adapters import DemoAssets
from acelora_kernels.engine import Engine
from acelora_kernels.pool import AdapterPool
from acelora_kernels.tiny import load_model_and_tokenizer

WIRE = Path(__file__).parents[1] / "fixtures" / "wire"
CHAT = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


def wire(name: str) -> dict[str, Any]:
    """A recorded vLLM exchange from ``tests/fixtures/wire``."""
    return json.loads((WIRE / f"{name}.json").read_text())


class LiveServer(BackgroundServer):
    """A uvicorn server for ``app`` on a free loopback port, in a background thread, started at once."""

    def __init__(self, app: Any) -> None:
        super().__init__(app, lifespan="off")
        self.start()

    def close(self) -> None:
        self.stop()


def make_engine(demo: DemoAssets, **kwargs: Any) -> Engine:
    model, tok = load_model_and_tokenizer(demo.base_dir)
    pool_bytes = kwargs.pop("pool_bytes", 64 << 20)
    return Engine(model, tok, AdapterPool.for_model(model, pool_bytes), dict(demo.adapters), **kwargs)

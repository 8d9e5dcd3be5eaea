"""Engine test fixtures: the five seed demo adapters (made once per session), engines, live servers.

Servers are real uvicorn instances on loopback (port 0), driven by the real ``openai`` SDK.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from acelora_kernels.demo_adapters import DemoAssets, demo_assets  # noqa: E402
from acelora_kernels.engine import Engine  # noqa: E402
from acelora_kernels.pool import AdapterPool  # noqa: E402
from acelora_kernels.server import create_app  # noqa: E402
from acelora_kernels.tiny import TINY_MODEL_NAME, load_model_and_tokenizer  # noqa: E402

WIRE = Path(__file__).parents[1] / "fixtures" / "wire"
CHAT = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


def wire(name: str) -> dict[str, Any]:
    """A recorded vLLM exchange from ``tests/fixtures/wire``."""
    return json.loads((WIRE / f"{name}.json").read_text())


class LiveServer:
    """A uvicorn server for ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.app = app

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """The tiny base model and the five seed demo adapters, trained once for the session."""
    return demo_assets(5, cache_dir=tmp_path_factory.mktemp("acelora-cache"))


def make_engine(demo: DemoAssets, **kwargs: Any) -> Engine:
    model, tok = load_model_and_tokenizer(demo.base_dir)
    pool_bytes = kwargs.pop("pool_bytes", 64 << 20)
    return Engine(model, tok, AdapterPool.for_model(model, pool_bytes), dict(demo.adapters), **kwargs)


@pytest.fixture(scope="session")
def engine(demo: DemoAssets) -> Iterator[Engine]:
    eng = make_engine(demo)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def extra_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second allowed adapter root for runtime-load tests (adapters written there by the tests)."""
    return tmp_path_factory.mktemp("runtime-adapters")


@pytest.fixture(scope="session")
def server(engine: Engine, demo: DemoAssets, extra_root: Path) -> Iterator[LiveServer]:
    app = create_app(
        engine,
        TINY_MODEL_NAME,
        model_root=str(demo.base_dir),
        allow_runtime_lora=True,
        adapter_roots=[demo.adapters_dir, extra_root],
        max_lora_rank=64,
        max_body_bytes=64 << 10,
    )
    live = LiveServer(app)
    yield live
    live.close()


@pytest.fixture(scope="session")
def locked_server(engine: Engine) -> Iterator[LiveServer]:
    """The same engine behind an app with runtime adapter loading disabled (vLLM's default)."""
    live = LiveServer(create_app(engine, TINY_MODEL_NAME, allow_runtime_lora=False))
    yield live
    live.close()


@pytest.fixture(scope="session")
def small_server(demo: DemoAssets) -> Iterator[LiveServer]:
    """A pool with room for about two adapters and at most two adapters per batch: the rest queue."""
    sizes = sorted(p.joinpath("adapter_model.safetensors").stat().st_size for p in demo.adapters.values())
    eng = make_engine(demo, pool_bytes=sizes[-1] + sizes[-2] + (64 << 10), max_loras=2)
    live = LiveServer(create_app(eng, TINY_MODEL_NAME))
    yield live
    live.close()
    eng.close()

"""Engine test fixtures: the five seed demo adapters (made once per session), engines, live servers.

Servers are real uvicorn instances on loopback (port 0), driven by the real ``openai`` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_support import LiveServer, make_engine  # noqa: E402

from acelora_kernels.demo_adapters import DemoAssets, demo_assets  # noqa: E402
from acelora_kernels.engine import Engine  # noqa: E402
from acelora_kernels.server import create_app  # noqa: E402
from acelora_kernels.tiny import TINY_MODEL_NAME  # noqa: E402


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """The tiny base model and the five seed demo adapters, trained once for the session."""
    return demo_assets(5, cache_dir=tmp_path_factory.mktemp("acelora-cache"))


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

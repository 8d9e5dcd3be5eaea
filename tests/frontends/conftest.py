"""Fixtures of the front-end tests: a vLLM-dialect upstream on loopback, a registry, skills, gateways."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from upstream import BASE, MIB, ServerThread, UpstreamState, create_upstream, make_registry  # noqa: E402

from acelora.fleet import Fleet, ModelServer  # noqa: E402
from acelora.gateway import create_gateway  # noqa: E402
from acelora.skill import MultiLoRA  # noqa: E402


@pytest.fixture(scope="module")
def upstream_server() -> Iterator[tuple[ServerThread, UpstreamState]]:
    state = UpstreamState()
    with ServerThread(create_upstream(state)) as srv:
        yield srv, state


@pytest.fixture()
def upstream(upstream_server: tuple[ServerThread, UpstreamState]) -> UpstreamState:
    """The module's upstream, reset: base ``tiny-llama``, nothing loaded, ``broken-v1`` fails to load."""
    srv, state = upstream_server
    state.reset(fail_loads={"broken-v1"})
    state.url = srv.url  # type: ignore[attr-defined]
    return state


@pytest.fixture()
def make_skill(upstream: UpstreamState) -> Callable[..., MultiLoRA]:
    """``make_skill(mode, fleet=True, **kw)``: a fresh skill; with ``fleet`` the upstream is its one server."""

    def make(mode: str = "prod", fleet: bool = True, max_lora_rank: int | None = 16, **kw: Any) -> MultiLoRA:
        servers = []
        if fleet:
            servers.append(ModelServer(name="vllm-primary", endpoint=upstream.url,  # type: ignore[attr-defined]
                                       kind="vllm", base_model=BASE, max_lora_rank=max_lora_rank,
                                       base_model_bytes=512 * MIB))
        kw.setdefault("base_model", BASE)
        if not fleet:
            kw.setdefault("max_lora_rank", max_lora_rank)
        return MultiLoRA(registry=make_registry(), fleet=Fleet(servers), mode=mode, **kw)

    return make


@pytest.fixture()
def gateway() -> Iterator[Callable[..., str]]:
    """``gateway(skill, **create_gateway_kwargs) -> base URL`` of that gateway served by uvicorn on loopback."""
    running: list[ServerThread] = []

    def start(skill: MultiLoRA, **kw: Any) -> str:
        srv = ServerThread(create_gateway(skill, **kw)).__enter__()
        running.append(srv)
        return srv.url

    yield start
    for srv in running:
        srv.__exit__(None, None, None)

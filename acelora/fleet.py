"""Upstream model servers (vLLM, SGLang, OpenAI-compatible) and the fleet that holds them."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash

from acelora.errors import ConfigError
from acelora.names import check_adapter_name
from acelora.registry import ENGINE_KINDS


@dataclass(slots=True, eq=False)
class ModelServer:
    """One upstream server of one base model.

    >>> ModelServer(name="vllm-primary", endpoint="http://gpu1:8000", kind="vllm", base_model="m").kind
    'vllm'
    """

    name: str
    endpoint: str
    kind: str = "vllm"
    base_model: str | None = None
    api_key_env: str | None = None
    capacity: int = 8
    max_lora_rank: int | None = None
    base_model_bytes: int | None = None
    runtime_loading: bool | None = None
    resident: set[str] = field(default_factory=set)
    healthy: bool = True
    name_hash: int = 0

    def __post_init__(self) -> None:
        check_adapter_name(self.name)
        if self.kind not in ENGINE_KINDS:
            raise ConfigError(f"server {self.name}: kind {self.kind!r} is not one of {', '.join(ENGINE_KINDS)}")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"server {self.name}: endpoint {self.endpoint!r} must start with http:// or https://")
        self.endpoint = self.endpoint.rstrip("/").removesuffix("/v1")  # load/probe routes live at the root
        self.name_hash = xxhash.xxh3_64_intdigest(self.name.encode())

    @property
    def api_key(self) -> str | None:
        """The key read from the environment variable named by ``api_key_env`` (never stored)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @property
    def openai_base_url(self) -> str:
        """Where OpenAI routes live: ``<endpoint>/v1``."""
        return self.endpoint + "/v1"

    def public_dict(self) -> dict[str, object]:
        """What the fleet admin API shows (no key, only whether one is configured)."""
        return {
            "name": self.name, "endpoint": self.endpoint, "kind": self.kind, "base_model": self.base_model,
            "capacity": self.capacity, "max_lora_rank": self.max_lora_rank, "runtime_loading": self.runtime_loading,
            "resident": sorted(self.resident), "healthy": self.healthy, "has_api_key": bool(self.api_key_env),
        }


def same_base(a: str | None, b: str | None) -> bool:
    """Two base-model names refer to the same model (equal, or equal last path component, any case).

    >>> same_base("meta-llama/Llama-3.3-70B-Instruct", "/models/llama-3.3-70b-instruct")
    True
    """
    if a is None or b is None:
        return True
    if a == b:
        return True
    return a.rstrip("/").rsplit("/", 1)[-1].lower() == b.rstrip("/").rsplit("/", 1)[-1].lower()


class Fleet:
    """The servers acelora may route to, by name.

    >>> len(Fleet([]))
    0
    """

    def __init__(self, servers: Iterable[ModelServer] = ()) -> None:
        self._servers: dict[str, ModelServer] = {}
        self._lock = threading.Lock()
        self.version = 0  # bumped on every change of membership; route() caches per version
        for s in servers:
            self.add(s)

    def add(self, server: ModelServer) -> ModelServer:
        with self._lock:
            self._servers[server.name] = server
            self.version += 1
        return server

    def remove(self, name: str) -> ModelServer | None:
        with self._lock:
            self.version += 1
            return self._servers.pop(name, None)

    def get(self, name: str) -> ModelServer | None:
        return self._servers.get(name)

    @property
    def servers(self) -> list[ModelServer]:
        return list(self._servers.values())

    def base_models(self) -> set[str]:
        return {s.base_model for s in self._servers.values() if s.base_model}

    def touch(self) -> None:
        """Say that servers' attributes changed (base model, max rank, health…): cached placements are stale."""
        with self._lock:
            self.version += 1

    async def probe(self, client: Any = None, timeout_s: float = 10.0) -> dict[str, str | None]:
        """Ask every server what it serves and supports (``acelora.loading.probe_server``), concurrently.
        Returns ``{name: None}`` for each server probed and ``{name: "why"}`` for each that failed.

        >>> errors = await fleet.probe()  # doctest: +SKIP
        """
        import asyncio

        import httpx

        from acelora.loading import probe_server

        async def one(server: ModelServer, http: httpx.AsyncClient) -> str | None:
            try:
                await probe_server(server, http, timeout_s=timeout_s)
            except Exception as e:  # one odd server must not stop the others (or a gateway's start-up)
                return f"{type(e).__name__}: {e}"
            return None

        async def run(http: httpx.AsyncClient) -> dict[str, str | None]:
            servers = self.servers
            results = await asyncio.gather(*(one(s, http) for s in servers))
            return {s.name: r for s, r in zip(servers, results, strict=True)}

        try:
            if client is not None:
                return await run(client)
            async with httpx.AsyncClient() as http:
                return await run(http)
        finally:
            self.touch()

    def mark_resident(self, server: str, adapter: str, resident: bool = True) -> None:
        s = self._servers.get(server)
        if s is not None:
            (s.resident.add if resident else s.resident.discard)(adapter)

    def __len__(self) -> int:
        return len(self._servers)

    def __iter__(self) -> Iterator[ModelServer]:
        return iter(self.servers)

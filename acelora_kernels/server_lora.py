"""vLLM's runtime adapter routes: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Mixed into :class:`acelora_kernels.server.EngineServer`; routed only when runtime updating is on.
On top of vLLM's checks (empty fields, duplicates, missing path -> 404, incompatible -> 500), a
name must be an identifier, and a path must be absolute and resolve (symlinks followed) inside an
allowed adapter directory: a relative path or Hub id is never loaded. So must every file the load
reads (a symlinked ``adapter_model.safetensors`` cannot pull in a file from elsewhere), and each
must be a regular file (a FIFO would hang the reader).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from acelora.errors import IncompatibleAdapter, InvalidAdapter
from acelora.names import check_adapter_name, is_valid_adapter_name
from acelora.peft_format import CONFIG_NAME, PICKLE_NAME, SAFETENSORS_NAME, read_config
from acelora_kernels import vllm_wire as wire
from acelora_kernels.errors import AdapterInUse, PoolFull
from acelora_kernels.loader import plan_adapter

if TYPE_CHECKING:
    from acelora_kernels.engine import Engine


class RuntimeLoraRoutes:
    """Load/unload handlers (a mixin of ``EngineServer``, which sets the attributes below).

    >>> httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x-v1", "lora_path": "/adapters/x-v1"})  # doctest: +SKIP
    """

    engine: Engine
    name: str
    roots: list[Path]
    max_lora_rank: int
    sent_paths: dict[str, str]
    _admin: asyncio.Lock
    parse: Callable[[Request, type[BaseModel]], Awaitable[Any]]  # the body, validated, or an error Response

    async def load_adapter(self, request: Request) -> Response:
        """``POST /v1/load_lora_adapter``: validate, register, warm the pool; plain-text 200."""
        req = await self.parse(request, wire.LoadLoRAAdapterRequest)
        if isinstance(req, Response):
            return req
        name, sent = req.lora_name, req.lora_path
        if not name or not sent:
            return wire.error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.name:
            return wire.error(400, f"The lora adapter name '{name}' is the served base model's name.",
                              "InvalidUserInput")  # fmt: skip
        if not is_valid_adapter_name(name):
            return wire.error(400, str(_name_error(name)), "InvalidUserInput")
        async with self._admin:
            if self.engine.adapter_path(name) is not None and not req.load_inplace:
                return wire.error(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                  "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")  # fmt: skip
            path = Path(sent)
            if not path.is_absolute():
                return wire.error(400, "lora_path must be an absolute path to a local adapter directory; relative "
                                  "paths and Hub ids are never loaded.", "InvalidUserInput")  # fmt: skip
            resolved = path.resolve()  # symlinks are followed before the containment check
            if not any(resolved.is_relative_to(root) for root in self.roots):
                return wire.error(400, wire.redact(f"lora_path {sent} is outside the allowed adapter directories."),
                                  "InvalidUserInput")  # fmt: skip
            escape = outside_roots(resolved, self.roots)
            if escape is not None:
                return wire.error(400, wire.redact(f"lora_path {sent}: {escape}"), "InvalidUserInput")
            if not (resolved / CONFIG_NAME).is_file():
                return wire.error(404, wire.redact(f"Loading lora {name} failed: No adapter found for {sent}"),
                                  "NotFoundError")  # fmt: skip
            problem = await asyncio.to_thread(self._check_adapter, resolved)
            if problem is not None:
                return wire.error(
                    500, wire.redact(f"Call to add_lora method failed: {problem}"), "InternalServerError"
                )
            if req.load_inplace:
                self.engine.reload(name)
            self.engine.register(name, resolved)
            self.sent_paths[name] = sent
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.engine.prefetch(name)), timeout=30)
            except (InvalidAdapter, IncompatibleAdapter) as e:  # e.g. NaN weights, only seen when read
                self.engine.unregister(name)
                self.sent_paths.pop(name, None)
                return wire.error(
                    500, wire.redact(f"Call to add_lora method failed: {e}"), "InternalServerError"
                )
            except (PoolFull, AdapterInUse, TimeoutError):
                pass  # registered; it loads on first use, when room frees up
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    def _check_adapter(self, path: Path) -> str | None:
        try:
            config = read_config(path)
            if config.max_rank > self.max_lora_rank:
                return f"LoRA rank {config.max_rank} is greater than max_lora_rank {self.max_lora_rank}."
            plan_adapter(path, self.engine.pool.modules, self.engine.pool.dtype)
        except (InvalidAdapter, IncompatibleAdapter) as e:
            return str(e)
        return None

    async def unload_adapter(self, request: Request) -> Response:
        """``POST /v1/unload_lora_adapter``: forget the name (in-flight requests finish); plain-text 200."""
        req = await self.parse(request, wire.UnloadLoRAAdapterRequest)
        if isinstance(req, Response):
            return req
        if not req.lora_name:
            return wire.error(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        async with self._admin:
            if (
                self.engine.adapter_path(req.lora_name) is None
                or req.lora_name not in self.engine.adapter_names()
            ):
                return wire.error(
                    404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError"
                )
            self.engine.unregister(req.lora_name)
            self.sent_paths.pop(req.lora_name, None)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", status_code=200)


#: every file loading an adapter directory may open
ADAPTER_FILES = (CONFIG_NAME, SAFETENSORS_NAME, PICKLE_NAME)


def outside_roots(adapter_dir: Path, roots: Sequence[Path]) -> str | None:
    """Why loading ``adapter_dir`` would read outside ``roots`` (or a non-regular file); None if it would not.

    >>> outside_roots(Path("/adapters/x-v1"), [Path("/adapters")])  # doctest: +SKIP
    'adapter_model.safetensors resolves outside the allowed adapter directories'
    """
    real_roots = [Path(r).resolve() for r in roots]

    def inside(p: Path) -> bool:
        real = p.resolve()
        return any(real.is_relative_to(r) for r in real_roots)

    if not inside(adapter_dir):
        return "the adapter directory resolves outside the allowed adapter directories"
    for name in ADAPTER_FILES:
        file = adapter_dir / name
        if not (file.is_symlink() or file.exists()):
            continue  # a missing file is the loader's own error
        if not inside(file):
            return f"{name} resolves outside the allowed adapter directories"
        if not file.resolve().is_file():
            return f"{name} is not a regular file"
    return None


def _name_error(name: str) -> Exception:
    try:
        check_adapter_name(name)
    except Exception as e:
        return e
    return ValueError(name)

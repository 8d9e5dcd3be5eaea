"""Continuous-batching generation in which every sequence may use a different LoRA adapter.

One background thread owns the model. Between decode steps it admits waiting requests (prefill as
one left-padded batch, then merged into the running batch's KV cache), runs one decode step for
every running sequence through ``lora_batch`` (one adapter name per row), samples, and streams
text to each request's sink. Adapters are made resident on demand through the pool: warm ones at
once, cold ones by ``pool.prefetch`` while the batch keeps decoding. A request whose adapter does
not fit (pool full of adapters the running batch uses, or ``max_loras`` distinct adapters already
running) waits until room frees up; it never fails for lack of room.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from acelora.errors import AdapterNotFound
from acelora_kernels.engine_loop import AdapterFailed, EngineLoop, Seq
from acelora_kernels.errors import AdapterInUse, AdapterNotResident
from acelora_kernels.kv_batch import KVBatch
from acelora_kernels.layers import attach
from acelora_kernels.leases import AdapterLeases
from acelora_kernels.pool import AdapterPool, LoadResult
from acelora_kernels.textgen import (
    Detokenizer,
    GenerationResult,
    SamplingParams,
    StreamEvent,
)

#: Below this many parameters the engine thread runs torch single-threaded: the matmuls are so small
#: that OpenMP's fork/join costs more than it saves (measured: 1.6x faster mixed decode on the tiny model).
SMALL_MODEL_PARAMS = 50_000_000

Resolver = Callable[[str], "str | os.PathLike[str] | None"]


class RequestHandle:
    """What :meth:`Engine.submit` returns: ``cancel()`` stops the request at the next step.

    >>> handle = engine.submit(ids, adapter="med-qa-v1", sink=print); handle.cancel()  # doctest: +SKIP
    """

    __slots__ = ("_seq", "_engine")

    def __init__(self, seq: Seq, engine: Engine) -> None:
        self._seq, self._engine = seq, engine

    def cancel(self) -> None:
        """Stop the request at the next step (its last event has ``finish_reason="abort"``)."""
        self._seq.cancelled = True
        self._engine._wake()


class Engine(EngineLoop):
    """Batched multi-adapter generation over an HF causal LM, a tokenizer and an :class:`AdapterPool`.

    ``adapters`` maps names to PEFT directories, or is a resolver ``name -> path | None``. Without a
    ``pool`` one of ``pool_bytes`` is made. ``max_batch`` bounds the running sequences, ``max_loras``
    the distinct adapters among them (vLLM's ``--max-loras``; extra requests wait). ``threads`` is the
    engine thread's torch thread count (default: 1 below 50 M parameters, else torch's setting).

    >>> engine = Engine(model, tok, adapters={"med-qa-v1": "/adapters/med-qa-v1"})  # doctest: +SKIP
    >>> engine.generate_sync(engine.encode_chat([{"role": "user", "content": "hi"}]), "med-qa-v1").text  # doctest: +SKIP
    '[med] Please consult a doctor.'
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        pool: AdapterPool | None = None,
        adapters: Mapping[str, str | os.PathLike[str]] | Resolver | None = None,
        *,
        max_batch: int = 64,
        max_loras: int | None = None,
        pool_bytes: int = 64 << 20,
        max_model_len: int | None = None,
        threads: int | None = None,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.pool = pool if pool is not None else AdapterPool.for_model(model, pool_bytes)
        attach(self.model, self.pool)
        self._paths: dict[str, Path] = {}
        self._failed: dict[str, str] = {}
        self._resolver: Resolver | None = None
        if callable(adapters):
            self._resolver = adapters
        else:
            for name, path in (adapters or {}).items():
                self.register(name, path)
        self.max_batch = max_batch
        self.max_loras = max_loras
        self.max_model_len = int(max_model_len or getattr(model.config, "max_position_embeddings", 2048))
        self.eos_ids = _eos_ids(model, tokenizer)
        small = sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS
        self.threads = threads if threads is not None else (1 if small else None)
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or len(tokenizer))
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cv = threading.Condition()
        self._inbox: list[Seq] = []
        self._waiting: list[Seq] = []
        self._running: list[Seq] = []
        self._batch = KVBatch()  # rows in self._running order
        self._leases = AdapterLeases(self.pool, max_loras, self._wake)
        self._stop = False
        self.stats = {"steps": 0, "prefills": 0, "tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="acelora-engine", daemon=True)
        self._thread.start()

    # -- adapters ------------------------------------------------------------------------------

    def register(self, name: str, path: str | os.PathLike[str]) -> None:
        """Make ``name`` servable from the PEFT directory ``path`` (loaded on first use).

        Registering again re-enables an adapter that was disabled after failing a forward pass.

        >>> engine.register("med-qa-v1", "/adapters/med-qa-v1")  # doctest: +SKIP
        """
        self._paths[name] = Path(path)
        self._failed.pop(name, None)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (in-flight requests finish; its pages go when the LRU needs them).

        >>> engine.unregister("med-qa-v1")  # doctest: +SKIP
        """
        self._paths.pop(name, None)
        self._failed.pop(name, None)

    def failed_adapters(self) -> dict[str, str]:
        """Adapters disabled because they broke a forward pass, with the reason (until registered again).

        >>> engine.failed_adapters()  # doctest: +SKIP
        {'alpha-neg': 'RuntimeError: value cannot be converted to type float without overflow'}
        """
        return dict(self._failed)

    def adapter_path(self, name: str) -> Path | None:
        """The directory ``name`` is served from, or None when it is unknown.

        >>> engine.adapter_path("no-such") is None  # doctest: +SKIP
        True
        """
        path = self._paths.get(name)
        if path is None and self._resolver is not None:
            found = self._resolver(name)
            path = Path(found) if found is not None else None
        return path

    def reload(self, name: str) -> None:
        """Drop ``name``'s pages unless the running batch uses it, so the next use reads the files again."""
        try:
            self.pool.evict(name)
        except (AdapterInUse, AdapterNotResident):
            pass

    def adapter_names(self) -> list[str]:
        """Registered adapter names, in registration order."""
        return list(self._paths)

    def prefetch(self, name: str) -> Future[LoadResult]:
        """Load ``name`` into the pool in the background without generating (the ``lora_prefetch`` hint).

        >>> engine.prefetch("legal-compliance-v1").result().cold  # doctest: +SKIP
        True
        """
        path = self.adapter_path(name)
        if path is None:
            raise AdapterNotFound(f"adapter {name!r} is not registered; register it before prefetching")
        fut = self.pool.prefetch(name, path)
        fut.add_done_callback(lambda _: self._wake())
        return fut

    # -- requests ------------------------------------------------------------------------------

    def encode_chat(self, messages: list[Mapping[str, Any]]) -> list[int]:
        """Prompt ids of a chat, rendered by the tokenizer's chat template with the generation prompt."""
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Prompt ids of plain text (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def submit(
        self,
        prompt_ids: list[int],
        adapter: str | None = None,
        params: SamplingParams | None = None,
        sink: Callable[[StreamEvent], None] | None = None,
    ) -> RequestHandle:
        """Queue a request; ``sink`` gets a :class:`StreamEvent` per step, from the engine thread.

        >>> engine.submit(ids, "med-qa-v1", SamplingParams(max_tokens=8), sink=print)  # doctest: +SKIP
        """
        params = params or SamplingParams()
        if adapter is not None and self.adapter_path(adapter) is None:
            raise AdapterNotFound(f"adapter {adapter!r} is not registered")
        if adapter is not None and adapter in self._failed:
            raise AdapterFailed(adapter, self._failed[adapter])
        if not prompt_ids:
            raise ValueError("prompt is empty; pass at least one token")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        gen = None
        if not params.greedy:
            gen = torch.Generator().manual_seed(
                params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            )
        seq = Seq(
            list(prompt_ids),
            adapter,
            params,
            sink or (lambda _e: None),
            Detokenizer(self.tokenizer, params.stop),
            gen,
        )
        with self._cv:
            if self._stop:
                raise RuntimeError("engine is closed")
            self._inbox.append(seq)
            self._cv.notify()
        return RequestHandle(seq, self)

    async def stream(
        self, prompt_ids: list[int], adapter: str | None = None, params: SamplingParams | None = None
    ) -> AsyncIterator[StreamEvent]:
        """Yield the request's events as they are produced; leaving the loop early cancels it.

        >>> async for ev in engine.stream(ids, "med-qa-v1"): print(ev.text, end="")  # doctest: +SKIP
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        handle = self.submit(
            prompt_ids, adapter, params, lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
        )
        finished = False
        try:
            while not finished:
                ev = await events.get()
                if ev.error is not None:
                    raise ev.error
                finished = ev.finished
                yield ev
        finally:
            if not finished:
                handle.cancel()

    async def generate(
        self, prompt_ids: list[int], adapter: str | None = None, params: SamplingParams | None = None
    ) -> GenerationResult:
        """Run one request to the end.

        >>> (await engine.generate(ids, "med-qa-v1")).finish_reason  # doctest: +SKIP
        'stop'
        """
        async for ev in self.stream(prompt_ids, adapter, params):
            if ev.result is not None:
                return ev.result
        raise RuntimeError("the engine stopped before the request finished")

    def generate_sync(
        self, prompt_ids: list[int], adapter: str | None = None, params: SamplingParams | None = None
    ) -> GenerationResult:
        """Blocking :meth:`generate` (from a thread that is not the event loop's)."""
        return self.generate_many([(prompt_ids, adapter, params)])[0]

    def generate_many(
        self, requests: Iterable[tuple[list[int], str | None, SamplingParams | None]]
    ) -> list[GenerationResult]:
        """Submit all requests at once (they batch together) and block until every one is done.

        >>> [r.text for r in engine.generate_many([(ids, "med-qa-v1", None), (ids, None, None)])]  # doctest: +SKIP
        """
        done: queue.Queue[tuple[int, StreamEvent]] = queue.Queue()
        items = list(requests)
        for i, (ids, adapter, params) in enumerate(items):
            self.submit(ids, adapter, params, lambda e, i=i: e.finished and done.put((i, e)))
        results: list[GenerationResult | None] = [None] * len(items)
        for _ in items:
            i, ev = done.get()
            if ev.error is not None:
                raise ev.error
            results[i] = ev.result
        return results  # type: ignore[return-value]

    def snapshot(self) -> dict[str, Any]:
        """Running/waiting request counts and the adapters with requests in flight (for metrics).

        >>> engine.snapshot()["num_running"]  # doctest: +SKIP
        0
        """
        with self._cv:
            running = [s for s in self._running if not s.done]
            waiting = [s for s in self._waiting + self._inbox if not s.done]
        return {
            "num_running": len(running),
            "num_waiting": len(waiting),
            "running_adapters": sorted({s.adapter for s in running if s.adapter}),
            "waiting_adapters": sorted({s.adapter for s in waiting if s.adapter}),
        }

    def close(self) -> None:
        """Stop the engine thread; unfinished requests get an error event."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self.pool.close()


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for v in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list | tuple):
            ids.update(int(x) for x in v)
    return frozenset(ids)

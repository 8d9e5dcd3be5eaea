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
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from acelora.errors import AdapterNotFound
from acelora_kernels.errors import AdapterInUse, AdapterNotResident
from acelora_kernels.kv_batch import KVBatch, cache_tensors, make_cache, select_rows
from acelora_kernels.layers import attach, lora_batch
from acelora_kernels.leases import AdapterLeases
from acelora_kernels.pool import AdapterPool, LoadResult
from acelora_kernels.textgen import (
    Detokenizer,
    GenerationResult,
    SamplingParams,
    StreamEvent,
    Timings,
    sample_next,
)

#: Below this many parameters the engine thread runs torch single-threaded: the matmuls are so small
#: that OpenMP's fork/join costs more than it saves (measured: 1.6x faster mixed decode on the tiny model).
SMALL_MODEL_PARAMS = 50_000_000

Resolver = Callable[[str], "str | os.PathLike[str] | None"]


@dataclass(eq=False, slots=True)
class _Seq:
    prompt: list[int]
    adapter: str | None
    params: SamplingParams
    sink: Callable[[StreamEvent], None]
    detok: Detokenizer
    gen: torch.Generator | None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    timings: Timings = field(default_factory=Timings)
    out: list[int] = field(default_factory=list)
    pos: int = 0  # tokens whose K/V are in the cache
    held: bool = False  # holds a lease on its adapter (admitted, not finished)
    cancelled: bool = False
    done: bool = False


class RequestHandle:
    """What :meth:`Engine.submit` returns: ``cancel()`` stops the request at the next step.

    >>> handle = engine.submit(ids, adapter="med-qa-v1", sink=print); handle.cancel()  # doctest: +SKIP
    """

    __slots__ = ("_seq", "_engine")

    def __init__(self, seq: _Seq, engine: Engine) -> None:
        self._seq, self._engine = seq, engine

    def cancel(self) -> None:
        self._seq.cancelled = True
        self._engine._wake()


class Engine:
    """Batched multi-adapter generation over an HF causal LM, a tokenizer and an :class:`AdapterPool`.

    ``adapters`` maps names to PEFT directories, or is a resolver ``name -> path | None``.

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
        self.tokenizer = tokenizer
        self.pool = pool if pool is not None else AdapterPool.for_model(model, pool_bytes)
        attach(self.model, self.pool)
        self._paths: dict[str, Path] = {}
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
        self._inbox: list[_Seq] = []
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._batch = KVBatch()  # rows in self._running order
        self._leases = AdapterLeases(self.pool, max_loras, self._wake)
        self._stop = False
        self.stats = {"steps": 0, "prefills": 0, "tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="acelora-engine", daemon=True)
        self._thread.start()

    # -- adapters ------------------------------------------------------------------------------

    def register(self, name: str, path: str | os.PathLike[str]) -> None:
        """Make ``name`` servable from the PEFT directory ``path`` (loaded on first use).

        >>> engine.register("med-qa-v1", "/adapters/med-qa-v1")  # doctest: +SKIP
        """
        self._paths[name] = Path(path)

    def unregister(self, name: str) -> None:
        """Forget ``name`` (in-flight requests finish; its pages go when the LRU needs them).

        >>> engine.unregister("med-qa-v1")  # doctest: +SKIP
        """
        self._paths.pop(name, None)

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
        if not prompt_ids:
            raise ValueError("prompt is empty; pass at least one token")
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
        seq = _Seq(
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

    # -- the engine thread ---------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # OpenMP: affects this thread only
        while True:
            with self._cv:
                while not (self._stop or self._inbox or self._running or self._admissible()):
                    if not self._cv.wait(timeout=1.0):
                        self._leases.unblock()  # pins held outside the engine may have been dropped
                if self._stop:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                self._step()
            except Exception as e:  # a failed forward fails the requests it touched, not the engine
                for s in self._running + self._waiting:
                    self._fail(s, e)
                self._running, self._waiting, self._batch = [], [], KVBatch()
        for s in self._running + self._waiting + self._inbox:
            self._fail(s, RuntimeError("engine closed"))

    def _admissible(self) -> bool:
        """Might a waiting request be admitted now (engine thread, lock held)?"""
        return len(self._running) < self.max_batch and any(
            s.cancelled or s.adapter is None or self._leases.may_progress(s.adapter) for s in self._waiting
        )

    def _step(self) -> None:
        for s in self._running + self._waiting:
            if s.cancelled and not s.done:
                self._finish(s, "abort", None)
        self._waiting = [s for s in self._waiting if not s.done]
        keep = [i for i, s in enumerate(self._running) if not s.done]
        if len(keep) != len(self._running):
            self._running = [self._running[i] for i in keep]
            self._batch.select(keep)
        admitted = self._schedule()
        if admitted:
            self._prefill(admitted)
        elif self._running:
            self._decode()

    def _schedule(self) -> list[_Seq]:
        free = self.max_batch - len(self._running)
        admitted: list[_Seq] = []
        for s in list(self._waiting):
            if free <= 0:
                break
            if s.adapter is not None:
                path = self.adapter_path(s.adapter)
                try:
                    if path is None:
                        raise AdapterNotFound(
                            f"adapter {s.adapter!r} was unregistered while the request waited"
                        )
                    cold = self._leases.take(s.adapter, path)
                except Exception as e:  # unloadable adapter: this request fails, the others go on
                    self._waiting.remove(s)
                    self._fail(s, e)
                    continue
                if cold is None:
                    continue
                s.held = True
                s.timings.adapter_cold_load = cold
                s.timings.adapter_ms = (time.perf_counter() - s.t_submit) * 1e3
            self._waiting.remove(s)
            admitted.append(s)
            s.timings.queue_ms = (time.perf_counter() - s.t_submit) * 1e3
            free -= 1
        return admitted

    # -- forward passes ------------------------------------------------------------------------

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        names: list[str | None],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, list[Any]]:
        cache = make_cache(kv)
        with lora_batch(self.model, names):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
        return out.logits[:, -1].float(), cache_tensors(cache)

    def _prefill(self, new: list[_Seq]) -> None:
        t0 = time.perf_counter()
        width = max(len(s.prompt) for s in new)
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        ids = torch.tensor([[pad] * (width - len(s.prompt)) + s.prompt for s in new])
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in new])
        pos = (mask.cumsum(1) - 1).clamp_(min=0)
        logits, kv = self._forward(ids, mask, pos, [s.adapter for s in new], [])
        ms = (time.perf_counter() - t0) * 1e3
        for s in new:
            s.pos, s.timings.prefill_ms = len(s.prompt), ms
        self.stats["prefills"] += 1
        self._emit(new, logits)
        keep = [i for i, s in enumerate(new) if not s.done]  # eos or max_tokens=1: done in prefill
        if keep:
            if len(keep) < len(new):
                kv, mask = select_rows(kv, mask, keep)
            self._batch.extend(kv, mask)
            self._running.extend(new[i] for i in keep)

    def _decode(self) -> None:
        rows = self._running
        ids = torch.tensor([[s.out[-1]] for s in rows])
        pos = torch.tensor([[s.pos] for s in rows])
        mask = self._batch.step_mask()
        logits, kv = self._forward(ids, mask, pos, [s.adapter for s in rows], self._batch.kv)
        self._batch.update(kv, mask)
        for s in rows:
            s.pos += 1
        self.stats["steps"] += 1
        self._emit(rows, logits)

    def _emit(self, rows: list[_Seq], logits: torch.Tensor) -> None:
        now = time.perf_counter()
        greedy = logits.argmax(-1).tolist()  # one op for every greedy row
        for s, row, best in zip(rows, logits, greedy, strict=True):
            if s.done:
                continue
            tok = best if s.gen is None else sample_next(row, s.params.temperature, s.params.top_p, s.gen)
            s.out.append(tok)
            self.stats["tokens"] += 1
            if not s.t_first:
                s.t_first = now
            if tok in self.eos_ids:
                self._finish(s, "stop", None)
                continue
            delta, stop = s.detok.push(tok)
            if stop is not None:
                self._finish(s, "stop", stop, delta)
            elif len(s.out) >= s.params.max_tokens or s.pos + 1 >= self.max_model_len:
                self._finish(s, "length", None, delta)
            elif delta:
                s.sink(StreamEvent(delta, [tok]))

    def _finish(self, s: _Seq, reason: str, stop_reason: str | int | None, delta: str = "") -> None:
        s.done = True
        tail = delta + s.detok.flush() if stop_reason is None else delta
        s.timings.decode_ms = (time.perf_counter() - s.t_first) * 1e3 if s.t_first else 0.0
        if s.held:
            s.held = False
            self._leases.give(s.adapter)  # type: ignore[arg-type]
        result = GenerationResult(
            s.detok.text, list(s.out), reason, stop_reason, len(s.prompt), len(s.out), s.adapter, s.timings
        )
        s.sink(StreamEvent(tail, s.out[-1:], reason, stop_reason, result=result))

    def _fail(self, s: _Seq, err: BaseException) -> None:
        if not s.done:
            s.done = True
            if s.held:
                s.held = False
                self._leases.give(s.adapter)  # type: ignore[arg-type]
            s.sink(StreamEvent("", [], error=err))


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

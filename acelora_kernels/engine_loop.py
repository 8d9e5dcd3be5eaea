"""What runs on the engine thread: admit waiting requests, prefill, decode, sample, finish.

Mixed into :class:`acelora_kernels.engine.Engine`, which owns the state these methods use (the
waiting/running lists, the running batch's :class:`KVBatch`, the adapter leases) and the public
request API. Only the engine thread calls these methods, except ``_wake``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from acelora.errors import AdapterNotFound
from acelora_kernels.kv_batch import KVBatch, cache_tensors, make_cache, select_rows
from acelora_kernels.layers import lora_batch
from acelora_kernels.leases import AdapterLeases
from acelora_kernels.textgen import (
    Detokenizer,
    GenerationResult,
    SamplingParams,
    StreamEvent,
    Timings,
    sample_next,
)


@dataclass(eq=False, slots=True)
class Seq:
    """One request's state inside the engine (prompt, sampling, output so far, timings)."""

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


class EngineLoop:
    """The engine thread's side of :class:`~acelora_kernels.engine.Engine` (a mixin).

    >>> issubclass(Engine, EngineLoop)  # doctest: +SKIP
    True
    """

    # set by Engine.__init__
    model: Any
    device: torch.device
    tokenizer: Any
    max_batch: int
    max_model_len: int
    eos_ids: frozenset[int]
    threads: int | None
    stats: dict[str, int]
    _cache_kw: str
    _cv: threading.Condition
    _inbox: list[Seq]
    _waiting: list[Seq]
    _running: list[Seq]
    _batch: KVBatch
    _leases: AdapterLeases
    _stop: bool
    adapter_path: Callable[[str], Path | None]

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
            self._admitting: list[Seq] = []
            try:
                self._step()
            except Exception as e:  # a failed forward fails the requests it touched, not the engine
                for s in self._running + self._admitting:
                    self._fail(s, e)
                self._running, self._batch = [], KVBatch()
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
        self._admitting = admitted = self._schedule()
        if admitted:
            self._prefill(admitted)
        elif self._running:
            self._decode()

    def _schedule(self) -> list[Seq]:
        free = self.max_batch - len(self._running)
        admitted: list[Seq] = []
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
        return out.logits[:, -1].float().cpu(), cache_tensors(cache)  # sampling runs on the CPU

    def _prefill(self, new: list[Seq]) -> None:
        t0 = time.perf_counter()
        width = max(len(s.prompt) for s in new)
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        dev = self.device
        ids = torch.tensor([[pad] * (width - len(s.prompt)) + s.prompt for s in new], device=dev)
        mask = torch.tensor([[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in new], device=dev)
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
        ids = torch.tensor([[s.out[-1]] for s in rows], device=self.device)
        pos = torch.tensor([[s.pos] for s in rows], device=self.device)
        mask = self._batch.step_mask()
        logits, kv = self._forward(ids, mask, pos, [s.adapter for s in rows], self._batch.kv)
        self._batch.update(kv, mask)
        for s in rows:
            s.pos += 1
        self.stats["steps"] += 1
        self._emit(rows, logits)

    def _emit(self, rows: list[Seq], logits: torch.Tensor) -> None:
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

    def _finish(self, s: Seq, reason: str, stop_reason: str | int | None, delta: str = "") -> None:
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

    def _fail(self, s: Seq, err: BaseException) -> None:
        if not s.done:
            s.done = True
            if s.held:
                s.held = False
                self._leases.give(s.adapter)  # type: ignore[arg-type]
            s.sink(StreamEvent("", [], error=err))

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

from acelora.errors import AceloraError, AdapterNotFound
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


class AdapterFailed(AceloraError, RuntimeError):
    """An adapter broke a forward pass (an error or non-finite logits): it is disabled until reloaded.

    >>> raise AdapterFailed("LoRA adapter 'x-v1' failed ...; reload it with load_inplace=true")  # doctest: +SKIP
    """

    def __init__(self, name: str, cause: str) -> None:
        super().__init__(
            f"LoRA adapter '{name}' failed during generation and was disabled ({cause}); "
            "fix its files and load it again (load_inplace=true) to serve it"
        )
        self.adapter = name


#: what a forward over some rows gives: last-position logits, the new K/V and the mask used
Step = tuple[torch.Tensor, list[Any], torch.Tensor]


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
    _failed: dict[str, str]  # adapter name -> why it was disabled
    adapter_path: Callable[[str], Path | None]
    reload: Callable[[str], None]

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
                    if s.adapter in self._failed:
                        raise AdapterFailed(s.adapter, self._failed[s.adapter])
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
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        dev = self.device

        def run(idx: list[int], base: bool = False) -> Step:
            rows = [new[i] for i in idx]
            width = max(len(s.prompt) for s in rows)
            ids = torch.tensor([[pad] * (width - len(s.prompt)) + s.prompt for s in rows], device=dev)
            mask = torch.tensor(
                [[0] * (width - len(s.prompt)) + [1] * len(s.prompt) for s in rows], device=dev
            )
            pos = (mask.cumsum(1) - 1).clamp_(min=0)
            names = [None if base else s.adapter for s in rows]
            return (*self._forward(ids, mask, pos, names, []), mask)

        idx, (logits, kv, mask) = self._isolate(new, run)
        new = [new[i] for i in idx]
        if not new:
            return
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
        names = [s.adapter for s in rows]

        def run(idx: list[int], base: bool = False) -> Step:
            if len(idx) == len(rows):
                return (*self._forward(ids, mask, pos, names, self._batch.kv), mask)
            kv, sub_mask = select_rows(self._batch.kv, mask, idx)  # padding columns stay: they are masked
            t = torch.tensor(idx, device=self.device)
            sub = [None if base else names[i] for i in idx]
            return (*self._forward(ids[t], sub_mask, pos[t], sub, kv), sub_mask)

        idx, (logits, kv, mask) = self._isolate(rows, run)
        if len(idx) < len(rows):
            rows = self._running = [rows[i] for i in idx]
        if not rows:
            self._batch = KVBatch()
            return
        self._batch.update(kv, mask)
        for s in rows:
            s.pos += 1
        self.stats["steps"] += 1
        self._emit(rows, logits)

    def _isolate(self, rows: list[Seq], run: Callable[..., Step]) -> tuple[list[int], Step]:
        """``run`` every row; when that raises, disable the adapters at fault and run the others again.

        The first row is tried alone on the base model, then each distinct adapter alone on one of
        its rows; the adapters that raise there (when the base model did not) are the culprits:
        their requests fail and the rest of the batch is stepped again without them. Otherwise the
        fault is not an adapter's and the error propagates (every row of the step fails).
        """
        every = list(range(len(rows)))
        try:
            return every, run(every)
        except Exception as err:
            culprits: dict[str, str] = {}
            try:
                run([0], base=True)
            except Exception:
                raise err from None
            for name in dict.fromkeys(s.adapter for s in rows if s.adapter is not None):
                first = next(i for i, s in enumerate(rows) if s.adapter == name)
                try:
                    run([first])
                except Exception as e:
                    culprits[name] = f"{type(e).__name__}: {e}"
            if not culprits:
                raise err from None
        for name, cause in culprits.items():
            self._disable(name, cause)
        idx = [i for i, s in enumerate(rows) if s.adapter not in culprits]
        return idx, (run(idx) if idx else (torch.empty(0), [], torch.empty(0)))

    def _disable(self, name: str, cause: str) -> None:
        """Fail every request of adapter ``name`` and refuse it until it is registered again."""
        self._failed[name] = cause
        err = AdapterFailed(name, cause)
        for s in self._running + self._admitting + self._waiting:
            if s.adapter == name:
                self._fail(s, err)
        self._waiting = [s for s in self._waiting if not s.done]
        self.reload(name)  # drop its pages (no request holds it now) so a reload reads the files again

    def _emit(self, rows: list[Seq], logits: torch.Tensor) -> None:
        now = time.perf_counter()
        greedy = logits.argmax(-1).tolist()  # one op for every greedy row
        finite = torch.isfinite(logits).all(-1).tolist()
        for s, row, best, ok in zip(rows, logits, greedy, finite, strict=True):
            if s.done:
                continue
            if not ok:  # rows are independent: only this row's adapter can have made it inf/NaN
                if s.adapter is None:
                    self._fail(s, FloatingPointError("the base model produced non-finite logits"))
                else:
                    self._disable(s.adapter, "its output logits are not finite (NaN or inf)")
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
                self._send(s, StreamEvent(delta, [tok]))

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
        self._send(s, StreamEvent(tail, s.out[-1:], reason, stop_reason, result=result))

    def _fail(self, s: Seq, err: BaseException) -> None:
        if not s.done:
            s.done = True
            if s.held:
                s.held = False
                self._leases.give(s.adapter)  # type: ignore[arg-type]
            self._send(s, StreamEvent("", [], error=err))

    def _send(self, s: Seq, ev: StreamEvent) -> None:
        try:
            s.sink(ev)
        except Exception:  # a sink that raises (its event loop closed) loses its request, not the batch
            s.cancelled = True

"""The per-request side of generation: sampling parameters, token choice, streaming text, results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens: greedy when ``temperature == 0``; ``seed`` makes sampling reproducible.

    >>> SamplingParams(max_tokens=32, temperature=0).greedy
    True
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax."""
        return self.temperature <= 0.0


@dataclass(slots=True)
class Timings:
    """Per-request wall times in milliseconds (``queue_ms`` includes the adapter wait).

    >>> Timings().queue_ms
    0.0
    """

    queue_ms: float = 0.0
    adapter_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    adapter_cold_load: bool = False


@dataclass(slots=True)
class GenerationResult:
    """A finished request: text, token counts, why it stopped and how long each phase took.

    >>> engine.generate_sync(ids, adapter="med-qa-v1").text  # doctest: +SKIP
    '[med] Please consult a doctor.'
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    adapter: str | None
    timings: Timings


@dataclass(slots=True)
class StreamEvent:
    """One step of one request: new text (possibly empty); the last event has the finish reason.

    >>> StreamEvent(text="[co", token_ids=[91, 99, 111]).finished
    False
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None
    result: GenerationResult | None = None

    @property
    def finished(self) -> bool:
        """True on the request's last event (finished or failed)."""
        return self.finish_reason is not None or self.error is not None


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Pick a token from one row of logits: argmax when greedy, else temperature + nucleus sampling.

    >>> sample_next(torch.tensor([0.0, 3.0, 1.0]), 0.0, 1.0, None)
    1
    """
    if temperature <= 0.0 or gen is None:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p  # the smallest prefix whose mass reaches top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back what a stop string may claim.

    Works with any tokenizer that has ``decode``: a multi-byte character split over tokens is only
    emitted once complete (decode of the tail no longer ends in U+FFFD).

    >>> from acelora_kernels.tiny import ByteTokenizer
    >>> d = Detokenizer(ByteTokenizer(), stop=("END",))
    >>> [d.push(t) for t in b"hi E"], d.push(ord("N")), d.push(ord("D"))
    ([('', None), ('', None), ('h', None), ('i', None)], (' ', None), ('', 'END'))
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (after a stop string: cut just before it)
        self.sent = 0  # characters of ``text`` already handed out
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> tuple[str, str | None]:
        """Add one token; returns ``(text to send now, matched stop string or None)``."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            start = max(0, len(self.text) - self.hold)
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
            if hits:
                at, s = min(hits)
                self.text = self.text[:at]
                return self._take(len(self.text)), s
        return self._take(len(self.text) - self.hold), None

    def flush(self) -> str:
        """The held-back rest, at the end of generation (no stop string can complete any more)."""
        rest = self._decode(self.ids[self._prefix :])[
            len(self._decode(self.ids[self._prefix : self._read])) :
        ]
        self.text += rest
        self._prefix = self._read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

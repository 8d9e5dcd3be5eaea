"""The engine: per-row adapters, batching equals one-at-a-time, stops, sampling, queueing, LRU."""

from __future__ import annotations

import queue
import threading

import pytest
from engine_support import CHAT, make_engine

from acelora.errors import AdapterNotFound
from acelora_kernels.engine import Engine, SamplingParams
from acelora_kernels.textgen import StreamEvent

GREEDY = SamplingParams(max_tokens=48, temperature=0)
PROMPTS = [
    CHAT,
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a contract?"}],
]


def test_each_demo_adapter_answers_with_its_marker_and_the_base_model_does_not(engine: Engine, demo) -> None:
    for messages in PROMPTS:
        ids = engine.encode_chat(messages)
        base = engine.generate_sync(ids, None, GREEDY).text
        for name, marker in demo.markers.items():
            out = engine.generate_sync(ids, name, GREEDY)
            assert out.text.startswith(marker), (name, out.text)
            assert out.finish_reason == "stop" and out.stop_reason is None
            assert out.adapter == name and out.prompt_tokens == len(ids)
        assert not any(base.startswith(m) for m in demo.markers.values())


def test_mixed_adapter_batch_equals_one_request_at_a_time(engine: Engine, demo) -> None:
    names = [None, *demo.adapters]
    requests = [
        (engine.encode_chat(PROMPTS[i % len(PROMPTS)]), names[i % len(names)], GREEDY) for i in range(12)
    ]
    alone = [engine.generate_sync(*r) for r in requests]
    together = engine.generate_many(requests)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]


def test_stop_string_cuts_the_text_before_it_and_reports_it(engine: Engine) -> None:
    ids = engine.encode_chat(CHAT)
    out = engine.generate_sync(
        ids, "med-qa-v1", SamplingParams(max_tokens=48, temperature=0, stop=("consult", "zz"))
    )
    assert out.text == "[med] Please "
    assert (out.finish_reason, out.stop_reason) == ("stop", "consult")


def test_streamed_deltas_never_include_the_stop_string(engine: Engine) -> None:
    events: queue.Queue[StreamEvent] = queue.Queue()
    params = SamplingParams(max_tokens=48, temperature=0, stop=("def f",))
    engine.submit(engine.encode_chat(CHAT), "code-python-v2", params, events.put)
    text = ""
    while True:
        ev = events.get(timeout=60)
        text += ev.text
        if ev.finished:
            break
    assert text == "[code] " and ev.stop_reason == "def f"


def test_max_tokens_ends_with_length(engine: Engine) -> None:
    out = engine.generate_sync(
        engine.encode_chat(CHAT), "fin-analyst-v1", SamplingParams(max_tokens=4, temperature=0)
    )
    assert (out.finish_reason, out.completion_tokens, out.text) == ("length", 4, "[fin")


def test_seeded_sampling_is_reproducible_and_seeds_matter(engine: Engine) -> None:
    ids = engine.encode_chat([{"role": "user", "content": "Tell me something."}])

    def sample(seed: int) -> list[int]:
        return engine.generate_sync(
            ids, None, SamplingParams(max_tokens=24, temperature=1.5, top_p=0.95, seed=seed)
        ).token_ids

    assert sample(7) == sample(7)
    assert len({tuple(sample(s)) for s in range(4)}) > 1


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(engine: Engine) -> None:
    ids = engine.encode_chat(CHAT)
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    alone = engine.generate_sync(ids, "legal-compliance-v1", p).token_ids
    batch = engine.generate_many(
        [(ids, "legal-compliance-v1", p), (ids, None, p), (ids, "med-qa-v1", GREEDY)]
    )
    assert batch[0].token_ids == alone


def test_a_request_joins_a_running_batch_between_decode_steps(engine: Engine) -> None:
    first_token = threading.Event()
    long_done: queue.Queue[StreamEvent] = queue.Queue()

    def sink(ev: StreamEvent) -> None:
        first_token.set()
        if ev.finished:
            long_done.put(ev)

    ids = engine.encode_chat([{"role": "user", "content": "Talk for a long time."}])
    engine.submit(ids, None, SamplingParams(max_tokens=400, temperature=0), sink)
    assert first_token.wait(60)
    short = engine.generate_sync(engine.encode_chat(CHAT), "brand-voice-v1", GREEDY)
    assert short.text.startswith("[brand]")
    assert long_done.empty()  # the short request was admitted and finished while the long one decoded
    long = long_done.get(timeout=120).result
    assert (long.finish_reason, long.completion_tokens) == ("length", 400)


def test_unknown_adapter_is_refused_at_submit(engine: Engine) -> None:
    with pytest.raises(AdapterNotFound):
        engine.submit(engine.encode_chat(CHAT), "no-such-adapter")


def test_prompt_longer_than_the_context_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="context"):
        engine.submit([65] * engine.max_model_len, None, SamplingParams(max_tokens=8))


def test_prefetch_makes_an_adapter_resident_without_generating(demo) -> None:
    eng = make_engine(demo)
    try:
        assert "legal-compliance-v1" not in eng.pool
        res = eng.prefetch("legal-compliance-v1").result(timeout=30)
        assert res.cold and "legal-compliance-v1" in eng.pool
        out = eng.generate_sync(eng.encode_chat(CHAT), "legal-compliance-v1", GREEDY)
        assert out.text.startswith("[legal]") and not out.timings.adapter_cold_load
    finally:
        eng.close()


def test_more_adapters_than_the_pool_holds_all_answer_correctly(demo) -> None:
    sizes = sorted(p.joinpath("adapter_model.safetensors").stat().st_size for p in demo.adapters.values())
    eng = make_engine(demo, pool_bytes=sizes[-1] + (64 << 10), max_loras=1)
    try:
        ids = eng.encode_chat(CHAT)
        names = [*demo.adapters] * 2
        results = eng.generate_many([(ids, n, GREEDY) for n in names] + [(ids, None, GREEDY)])
        for name, res in zip(names, results, strict=False):
            assert res.text.startswith(demo.markers[name]), (name, res.text)
        stats = eng.pool.stats()
        assert stats["bytes_capacity"] < sum(sizes)  # the five never fitted at once...
        assert stats["evictions"] >= 1  # ...so the LRU made room
    finally:
        eng.close()


def test_cancelled_stream_frees_its_row_and_adapter(engine: Engine) -> None:
    events: queue.Queue[StreamEvent] = queue.Queue()
    handle = engine.submit(
        engine.encode_chat(CHAT), None, SamplingParams(max_tokens=500, temperature=0), events.put
    )
    events.get(timeout=60)
    handle.cancel()
    while not (ev := events.get(timeout=60)).finished:
        pass
    assert ev.finish_reason == "abort"
    assert engine.generate_sync(engine.encode_chat(CHAT), "med-qa-v1", GREEDY).text.startswith("[med]")
    assert engine.snapshot()["num_running"] == 0


def test_a_request_queued_for_an_adapter_that_is_unregistered_fails_cleanly(demo) -> None:
    eng = make_engine(demo, max_loras=1)
    try:
        ids = eng.encode_chat(CHAT)
        started = threading.Event()
        long_done: queue.Queue[StreamEvent] = queue.Queue()
        eng.submit(ids, "med-qa-v1", SamplingParams(max_tokens=300, temperature=1.0, seed=1),
                   lambda e: (started.set(), e.finished and long_done.put(e)))  # fmt: skip
        assert started.wait(60)
        waiting: queue.Queue[StreamEvent] = queue.Queue()
        eng.submit(ids, "legal-compliance-v1", GREEDY, lambda e: e.finished and waiting.put(e))
        eng.unregister("legal-compliance-v1")  # max_loras=1: it is still queued behind med-qa-v1
        ev = waiting.get(timeout=120)
        assert isinstance(ev.error, AdapterNotFound)
        assert long_done.get(timeout=120).result.completion_tokens >= 1
        assert eng.generate_sync(ids, "code-python-v2", GREEDY).text.startswith("[code]")
    finally:
        eng.close()

"""One broken adapter fails only its own requests; the batch it shared keeps its exact outputs."""

from __future__ import annotations

import asyncio
import json
import queue
import shutil

import httpx
import pytest
from engine_support import CHAT, LiveServer, make_engine

from acelora_kernels import layers
from acelora_kernels.engine import AdapterFailed, SamplingParams
from acelora_kernels.server import create_app
from acelora_kernels.tiny import TINY_MODEL_NAME

GOOD = ["med-qa-v1", None, "code-python-v2"]
PARAMS = SamplingParams(max_tokens=24, temperature=0)


def inject_fault(monkeypatch, model, bad: str, mode: str, phase: str) -> None:
    """Make adapter ``bad``'s LoRA math raise (``mode="raise"``) or give NaN (``"nan"``) in ``phase``."""
    att, real = getattr(model, layers._ATTR), layers.ops.add_lora

    def add_lora(x, out, meta, module):
        real(x, out, meta, module)
        batch = att.batch
        slots = [i for i, e in enumerate(batch.entries) if e.name == bad]
        if not slots or (phase == "decode") != (meta.tokens_per_row == 1):
            return
        if mode == "raise":
            raise RuntimeError("injected fault in the LoRA op")
        rows = [r for r, s in enumerate(batch.row_slot) if s == slots[0]]
        out.view(len(batch.row_slot), -1, out.shape[-1])[rows] = float("nan")

    monkeypatch.setattr(layers.ops, "add_lora", add_lora)


def run_all(engine, adapters):
    """Submit every request at once; each one's final event (result or error), bounded wait."""
    ids = engine.encode_chat(CHAT)
    done: queue.Queue = queue.Queue()
    for i, name in enumerate(adapters):
        engine.submit(ids, name, PARAMS, lambda e, i=i: e.finished and done.put((i, e)))
    finals = dict(done.get(timeout=60) for _ in adapters)
    return [finals[i] for i in range(len(adapters))]


@pytest.fixture
def fresh(demo):
    eng = make_engine(demo)
    eng.register("faulty", demo.adapters["legal-compliance-v1"])
    yield eng
    eng.close()


@pytest.mark.parametrize("mode", ["raise", "nan"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_failing_adapter_fails_only_its_rows_and_is_disabled(fresh, monkeypatch, mode, phase) -> None:
    reference = [ev.result.token_ids for ev in run_all(fresh, GOOD)]
    inject_fault(monkeypatch, fresh.model, "faulty", mode, phase)
    events = run_all(fresh, ["faulty", *GOOD, "faulty"])
    for ev in (events[0], events[-1]):
        assert isinstance(ev.error, AdapterFailed) and ev.error.adapter == "faulty"
        assert "'faulty' failed during generation" in str(ev.error)
    assert [ev.error for ev in events[1:-1]] == [None] * len(GOOD)
    assert [ev.result.token_ids for ev in events[1:-1]] == reference  # as if it had never been there
    assert "faulty" in fresh.failed_adapters() and "faulty" not in fresh.pool
    with pytest.raises(AdapterFailed):  # it cannot poison a later batch
        fresh.submit(fresh.encode_chat(CHAT), "faulty", PARAMS)
    monkeypatch.undo()
    fresh.register("faulty", fresh.adapter_path("faulty"))  # an operator's reload re-enables it
    assert run_all(fresh, ["faulty"])[0].result.text.startswith("[legal]")


def test_a_fault_that_is_no_adapters_still_answers_every_request(fresh, monkeypatch) -> None:
    def broken(*_a, **_k):
        raise RuntimeError("injected fault in the base model")

    monkeypatch.setattr(fresh, "_forward", broken)
    events = run_all(fresh, ["faulty", *GOOD])
    assert all(isinstance(ev.error, RuntimeError) for ev in events)
    assert fresh.failed_adapters() == {}  # nobody is blamed when every adapter runs fine alone


@pytest.mark.parametrize(
    "edit", [{"lora_alpha": 1e39}, {"alpha_pattern": {"q_proj": -1e308}}, {"lora_alpha": float("nan")}]
)
def test_an_adapter_whose_scaling_overflows_never_hurts_its_batchmates(demo, fresh, tmp_path, edit) -> None:
    bad = tmp_path / "overflow"
    shutil.copytree(demo.adapters["med-qa-v1"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    fresh.register("overflow", bad)
    reference = [ev.result.token_ids for ev in run_all(fresh, GOOD)]
    events = run_all(fresh, ["overflow", *GOOD])
    assert events[0].error is not None  # refused when read, or disabled when it broke the step
    assert [ev.result.token_ids for ev in events[1:]] == reference


def test_server_answers_batchmates_200_and_the_bad_adapter_500(demo, fresh, monkeypatch) -> None:
    inject_fault(monkeypatch, fresh.model, "faulty", "raise", "decode")
    live = LiveServer(create_app(fresh, TINY_MODEL_NAME, request_timeout_s=60))
    try:

        async def main():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:

                async def one(model):
                    body = {"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0}
                    return await c.post("/v1/chat/completions", json=body)

                models = ["faulty", "med-qa-v1", TINY_MODEL_NAME] * 3
                return models, await asyncio.gather(*[one(m) for m in models])

        models, replies = asyncio.run(main())
        for model, r in zip(models, replies, strict=True):
            if model == "faulty":
                err = r.json()["error"]
                assert (r.status_code, err["type"], err["code"]) == (500, "InternalServerError", 500)
                assert "LoRA adapter 'faulty' failed" in err["message"]
            else:
                assert r.status_code == 200, r.text
        r = httpx.post(
            live.url + "/v1/chat/completions", json={"model": "faulty", "messages": CHAT}, timeout=30
        )
        assert r.status_code == 500 and "disabled" in r.json()["error"]["message"]
    finally:
        live.close()

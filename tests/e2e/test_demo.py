"""The README's main job, as a user runs it: every request's output matches the decision it got."""

import io

import pytest

pytest.importorskip("torch")


def test_demo_serves_mixed_adapters_through_gateway_and_wrapped_client(tmp_path):
    from acelora.demo import run_demo

    out = io.StringIO()
    rep = run_demo(n_adapters=5, rounds=2, concurrency=4, report_path=str(tmp_path / "r.json"), out=out)
    assert rep["outputs_as_expected"] == rep["requests"], out.getvalue()
    assert rep["actions"]["adapter_cold_loaded_applied"] == 5  # each adapter loaded once, through vLLM's API
    assert rep["actions"]["adapter_prefetched_applied"] >= 5
    assert rep["fallback_reasons"] == {"unknown_adapter": 3, "invalid_name": 1}
    assert rep["execute"]["output_text"].startswith("[fin]")
    assert rep["execute"]["trace"][0]["adapter_name"] == "fin-analyst-v1"
    assert (tmp_path / "r.json").exists()

"""Every example in examples/ runs as a user would run it, so the docs cannot rot."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(name):
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_wrap_openai_example_applies_allowed_adapter_and_falls_back_for_others():
    pytest.importorskip("torch")
    out = run("wrap_openai_client.py")
    lines = out.splitlines()
    assert "'[code]" in lines[0] and "model='code-python-v2'" in lines[0]
    # served statically (vLLM --lora-modules style): resident on arrival, nothing loaded
    assert "action=adapter_prefetched_applied" in lines[1]
    assert "'[med]" in lines[2] and "action=adapter_prefetched_applied" in lines[3]  # public: any tenant
    assert "action=fallback_base_model" in lines[5] and "fallback_reason=unknown_adapter" in lines[5]
    assert "actions: ['adapter_prefetched_applied', 'adapter_prefetched_applied', 'fallback_base_model']" in out


def test_fastapi_middleware_example_shows_the_decision_downstream():
    out = run("fastapi_middleware.py")
    assert "would run legal-compliance-v1 (adapter_cold_loaded_applied, fallback=None)" in out
    assert "would run my-base-model (fallback_base_model, fallback=unknown_adapter)" in out


def test_kernels_example_gives_each_row_its_own_adapter():
    pytest.importorskip("torch")
    out = run("kernels_mixed_batch.py")
    assert "code-python-v2   '[code]" in out and "med-qa-v1        '[med]" in out and "brand-voice-v1   '[brand]" in out
    base_line = next(line for line in out.splitlines() if line.startswith("None"))
    assert "[" not in base_line.split("'", 1)[1][:2]


def test_the_gateway_example_config_is_valid(tmp_path, monkeypatch):
    import shutil

    from acelora import MultiLoRA

    shutil.copy(EXAMPLES / "gateway" / "acelora.toml", tmp_path / "acelora.toml")
    (tmp_path / "adapters").mkdir()
    for var in ("ACELORA_KEY_DEV01", "ACELORA_KEY_MED", "ACELORA_ADMIN_KEY"):
        monkeypatch.setenv(var, f"sk-{var.lower()}")
    monkeypatch.delenv("ACELORA_MODE", raising=False)
    skill = MultiLoRA.from_config(str(tmp_path / "acelora.toml"))
    assert [s.kind for s in skill.fleet] == ["vllm", "sglang"] and skill.max_prefetch_hints == 4
    assert skill.api_keys == {"sk-acelora_key_dev01": "tenant_dev_01", "sk-acelora_key_med": "tenant_med"}
    assert not skill.registry.public_by_default and skill.config.gateway.max_stream_s == 900

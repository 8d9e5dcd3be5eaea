"""Shared fixtures: one tiny Llama and real PEFT adapters (ranks 4…64, patterns, rsLoRA) per session."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for peft_factory

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from peft_factory import ALL_LINEAR, ATTENTION, save_peft_adapter, tiny_llama  # noqa: E402

# name -> save_peft_adapter kwargs; every adapter targets the session's tiny Llama
ADAPTERS: dict[str, dict] = {
    "r4-attn": dict(seed=1, r=4, lora_alpha=8, target_modules=ATTENTION),
    "r16-patterns": dict(
        seed=2, r=16, lora_alpha=32, target_modules=ALL_LINEAR,
        rank_pattern={"q_proj": 8, "down_proj": 32}, alpha_pattern={"v_proj": 7},
    ),
    "r64-rslora": dict(seed=3, r=64, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "r32-mlp": dict(seed=4, r=32, lora_alpha=64, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "r8-layer0": dict(seed=5, r=8, lora_alpha=8, target_modules=ALL_LINEAR, layers_to_transform=[0]),
}  # fmt: skip


@pytest.fixture(scope="session")
def base_model():
    """The tiny Llama every adapter was trained for (never modified by a test: copy it first)."""
    torch.set_grad_enabled(False)
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def adapter_dirs(base_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_peft_adapter(base_model, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture()
def model(base_model):
    """A fresh copy of the base model that a test may attach hooks to."""
    return copy.deepcopy(base_model)


@pytest.fixture(scope="session")
def peft_model(base_model, adapter_dirs):
    """PEFT's own model holding every adapter, for its mixed-batch forward (``adapter_names=``)."""
    from peft import PeftModel

    names = list(adapter_dirs)
    pm = PeftModel.from_pretrained(
        copy.deepcopy(base_model), str(adapter_dirs[names[0]]), adapter_name=names[0]
    )
    for name in names[1:]:
        pm.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    return pm.eval()

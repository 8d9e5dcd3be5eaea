"""Triton kernels under TRITON_INTERPRET=1 equal the torch reference (run in a subprocess by
test_triton_interpreter.py so that the interpreter flag is set before Triton is imported)."""

from __future__ import annotations

import os

import pytest
import torch
from opcases import ROWS, dense_delta, loaded_pool, meta_for

from acelora_kernels import ops
from acelora_kernels.layers import attach, lora_batch
from acelora_kernels.ops import torch_ref

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpreter.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

triton_ops = ops.backend_module("triton")
MODULES = ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize("fragment", [False, True], ids=["contiguous", "scattered-pages"])
@pytest.mark.parametrize("tokens_per_row", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("module", MODULES)
def test_triton_forms_equal_torch_reference(base_model, adapter_dirs, module, tokens_per_row, fragment):
    pool = loaded_pool(base_model, adapter_dirs, fragment=fragment)
    meta_t = meta_for(pool, ROWS, tokens_per_row, "triton")
    meta_r = meta_for(pool, ROWS, tokens_per_row, "torch")
    spec = pool.modules[module]
    n = len(ROWS) * tokens_per_row
    x = torch.randn(n, spec.in_features, generator=torch.Generator().manual_seed(spec.index))
    base = torch.randn(n, spec.out_features, generator=torch.Generator().manual_seed(7))
    want = base + dense_delta(adapter_dirs, ROWS, tokens_per_row, module, x)
    for form in ("bgmv", "sgmv"):
        shrink, expand = getattr(triton_ops, f"{form}_shrink"), getattr(triton_ops, f"{form}_expand")
        y = shrink(x, meta_t, spec.index)
        torch.testing.assert_close(
            y, getattr(torch_ref, f"{form}_shrink")(x, meta_r, spec.index), atol=1e-5, rtol=1e-5
        )
        out = base.clone()
        expand(y, out, meta_t, spec.index)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_model_forward_on_triton_backend_equals_torch_backend(model, adapter_dirs, monkeypatch):
    pool = loaded_pool(model, adapter_dirs)
    attach(model, pool)
    rows = ["r64-rslora", None, "r16-patterns"]
    ids = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(3))
    step = torch.randint(0, 256, (3, 1), generator=torch.Generator().manual_seed(4))
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ops.BACKEND_ENV, backend)
        with lora_batch(model, rows):
            first = model(ids, use_cache=True)
            second = model(step, past_key_values=first.past_key_values, use_cache=True)
        results[backend] = (first.logits, second.logits)
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

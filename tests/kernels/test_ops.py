"""Torch multi-adapter ops: BGMV, SGMV and the fused path all equal the dense per-token oracle."""

from __future__ import annotations

import pytest
import torch
from opcases import ROWS, dense_delta, loaded_pool, meta_for

from acelora_kernels import ops
from acelora_kernels.ops import torch_ref

MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.v_proj",
    "model.layers.1.mlp.down_proj",
]


@pytest.mark.parametrize("fragment", [False, True], ids=["contiguous", "scattered-pages"])
@pytest.mark.parametrize("tokens_per_row", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("module", MODULES)
def test_every_torch_form_equals_the_dense_oracle(base_model, adapter_dirs, module, tokens_per_row, fragment):
    pool = loaded_pool(base_model, adapter_dirs, fragment=fragment)
    meta = meta_for(pool, ROWS, tokens_per_row, "torch")
    spec = pool.modules[module]
    n = len(ROWS) * tokens_per_row
    x = torch.randn(n, spec.in_features, generator=torch.Generator().manual_seed(spec.index))
    base = torch.randn(n, spec.out_features, generator=torch.Generator().manual_seed(99))
    want = base + dense_delta(adapter_dirs, ROWS, tokens_per_row, module, x)
    for shrink, expand in (
        (torch_ref.bgmv_shrink, torch_ref.bgmv_expand),
        (torch_ref.sgmv_shrink, torch_ref.sgmv_expand),
    ):
        out = base.clone()
        expand(shrink(x, meta, spec.index), out, meta, spec.index)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    out = base.clone()
    ops.add_lora(x, out, meta, spec.index)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_shrink_leaves_base_rows_and_unused_rank_columns_zero(base_model, adapter_dirs):
    pool = loaded_pool(base_model, adapter_dirs)
    meta = meta_for(pool, ["r4-attn", None, "r64-rslora"], 1, "torch")
    spec = pool.modules["model.layers.0.self_attn.k_proj"]
    y = torch_ref.bgmv_shrink(torch.randn(3, spec.in_features), meta, spec.index)
    assert y.shape == (3, 64)
    assert torch.all(y[1] == 0) and torch.all(y[0, 4:] == 0) and torch.all(y[2] != 0)


def test_metadata_groups_contiguous_rows_as_slices_and_scattered_rows_as_indices(base_model, adapter_dirs):
    pool = loaded_pool(base_model, adapter_dirs)
    meta = meta_for(pool, ["r4-attn", "r4-attn", None, "r32-mlp", "r4-attn"], 2, "torch")
    assert meta.segments == [(0, 4, 0), (6, 8, 1), (8, 10, 0)]
    (slot0, rows0), (slot1, rows1) = meta.groups
    assert rows0.tolist() == [0, 1, 2, 3, 8, 9] and rows1 == slice(6, 8)
    assert meta.token_slot.tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 0, 0]
    assert meta.seg_start.tolist() == [0, 6, 8] and meta.seg_end.tolist() == [4, 8, 10]


def test_backend_can_be_forced_by_environment(monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    assert ops.pick_backend("cuda") == "torch"
    monkeypatch.setenv(ops.BACKEND_ENV, "cuda-magic")
    with pytest.raises(ValueError, match="expected one of"):
        ops.pick_backend("cpu")
    monkeypatch.delenv(ops.BACKEND_ENV)
    assert ops.pick_backend("cpu") == "torch"


def test_cpu_scheduling_matches_the_reference_and_restores_torch_threads(base_model, adapter_dirs):
    pool = loaded_pool(base_model, adapter_dirs)
    meta = meta_for(pool, ROWS, 2, "torch")
    spec = pool.modules["model.layers.1.mlp.up_proj"]
    x = torch.randn(len(ROWS) * 2, spec.in_features, generator=torch.Generator().manual_seed(4))
    want, got = torch.zeros(x.shape[0], spec.out_features), torch.zeros(x.shape[0], spec.out_features)
    torch_ref.add_lora(x, want, meta, spec.index)
    threads = torch.get_num_threads()
    ops.add_lora(x, got, meta, spec.index)
    assert torch.get_num_threads() == threads
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got.abs().sum() > 0

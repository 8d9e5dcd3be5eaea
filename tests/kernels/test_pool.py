"""AdapterPool: exact-size paging, warm activation, LRU/pin/evict, failed loads change nothing."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from peft_factory import ATTENTION, save_peft_adapter, tiny_llama
from safetensors.torch import load_file, save_file

from acelora.errors import ConfigError, IncompatibleAdapter, InvalidAdapter
from acelora_kernels.errors import (
    AdapterInUse,
    AdapterNotResident,
    AdapterTooLarge,
    NonFiniteWeights,
    PoolFull,
)
from acelora_kernels.pool import AdapterPool

R4_ATTN_ELEMS = 2 * 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64))  # 2 layers x rank 4 x (d_in + d_out)


def _snapshot(pool: AdapterPool) -> tuple:
    s = pool.stats()
    return s["resident"], s["pinned"], s["pages_used"], s["bytes_used"]


@pytest.fixture()
def small_pool(base_model):
    """Room for exactly four r4-attn adapters (28 pages of 128 elements each)."""
    return AdapterPool.for_model(base_model, budget_bytes=4 * 28 * 128 * 4, page_elems=128)


def test_cold_load_takes_exactly_the_adapter_size_and_warm_load_only_touches(base_model, adapter_dirs):
    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20, page_elems=128)
    cold = pool.load("a", adapter_dirs["r4-attn"])
    assert (cold.cold, cold.bytes, cold.pages) == (True, R4_ATTN_ELEMS * 4, R4_ATTN_ELEMS // 128)
    warm = pool.load("a", adapter_dirs["r4-attn"])
    assert (warm.cold, warm.bytes, warm.pages) == (False, cold.bytes, cold.pages)
    assert pool.stats()["cold_loads"] == 1 and "a" in pool and pool.resident() == ["a"]


def test_pages_hold_the_files_weights(base_model, adapter_dirs):
    from acelora_kernels.ops.meta import adapter_views

    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20, page_elems=100)
    pool.load("p", adapter_dirs["r16-patterns"])
    tensors = load_file(adapter_dirs["r16-patterns"] / "adapter_model.safetensors")
    entry = pool.acquire(["p"])[0]
    views = adapter_views(pool, entry)
    for name, spec in pool.modules.items():
        key = f"base_model.model.{name}.lora_A.weight"
        if key in tensors:
            a, b, scaling = views[spec.index]
            assert torch.equal(a, tensors[key]) and torch.equal(b, tensors[key.replace("lora_A", "lora_B")])
            want = 7 / 16 if name.endswith("v_proj") else 32 / tensors[key].shape[0]
            assert scaling == pytest.approx(want)
    pool.release([entry])


def test_mixed_ranks_cost_their_size_not_a_max_rank_slot(base_model, adapter_dirs):
    pool = AdapterPool.for_model(base_model, budget_bytes=4 << 20, page_elems=1024)
    results = [pool.load(name, path) for name, path in adapter_dirs.items()]
    stats = pool.stats()
    assert stats["bytes_used"] == sum(r.bytes for r in results)
    assert stats["pages_used"] == sum(-(-r.bytes // stats["page_bytes"]) for r in results)
    assert stats["utilization"] >= 0.97
    padded = len(results) * 2 * 64 * sum(s.in_features + s.out_features for s in pool.modules.values()) * 4
    assert stats["bytes_used"] / padded < 0.5  # what padding every slot to rank 64 would waste


def test_lru_evicts_the_least_recently_used_unpinned_adapter(small_pool, adapter_dirs):
    path = adapter_dirs["r4-attn"]
    for name in "abcd":
        small_pool.load(name, path)
    small_pool.load("a", path)  # warm: a is now the most recent
    small_pool.pin("b")
    small_pool.load("e", path)  # full: evicts c (b is pinned)
    assert small_pool.resident() == ["b", "d", "a", "e"]
    assert small_pool.stats()["evictions"] == 1
    small_pool.unpin("b")
    small_pool.load("f", path)
    assert "b" not in small_pool


def test_adapters_in_the_running_batch_are_not_lru_victims(small_pool, adapter_dirs):
    path = adapter_dirs["r4-attn"]
    for name in "abcd":
        small_pool.load(name, path)
    held = small_pool.acquire(["a", "b", "c"])
    small_pool.load("e", path)  # only d may go
    assert small_pool.resident() == ["a", "b", "c", "e"]
    with pytest.raises(AdapterInUse):
        small_pool.evict("a")
    small_pool.release(held)
    small_pool.evict("a")
    assert "a" not in small_pool


def test_pool_full_when_everything_is_pinned_leaves_pool_unchanged(small_pool, adapter_dirs):
    for name in "abcd":
        small_pool.load(name, adapter_dirs["r4-attn"])
        small_pool.pin(name)
    before = _snapshot(small_pool)
    with pytest.raises(PoolFull, match="unpin"):
        small_pool.load("e", adapter_dirs["r4-attn"])
    assert _snapshot(small_pool) == before and "e" not in small_pool


def test_adapter_larger_than_the_pool_is_too_large(base_model, adapter_dirs):
    pool = AdapterPool.for_model(base_model, budget_bytes=64 << 10, page_elems=128)
    with pytest.raises(AdapterTooLarge, match="raise budget_bytes"):
        pool.load("big", adapter_dirs["r64-rslora"])
    assert pool.stats()["pages_used"] == 0


def test_budget_below_one_page_is_a_config_error(base_model):
    with pytest.raises(ConfigError, match="budget_bytes"):
        AdapterPool.for_model(base_model, budget_bytes=100, page_elems=4096)


def _with_nan(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    f = dst / "adapter_model.safetensors"
    tensors = load_file(f)
    key = sorted(k for k in tensors if "lora_B" in k)[-1]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("needs_eviction", [False, True])
def test_nan_weights_are_rejected_and_leave_the_pool_unchanged(
    small_pool, adapter_dirs, tmp_path, needs_eviction
):
    bad = _with_nan(adapter_dirs["r4-attn"], tmp_path / "nan")
    for name in "abcd"[: 4 if needs_eviction else 2]:
        small_pool.load(name, adapter_dirs["r4-attn"])
    before = _snapshot(small_pool)
    with pytest.raises(NonFiniteWeights, match="NaN or inf"):
        small_pool.load("bad", bad)
    assert _snapshot(small_pool) == before


def test_adapter_for_another_hidden_size_is_incompatible(base_model, tmp_path):
    other = save_peft_adapter(tiny_llama(seed=1, hidden=32, intermediate=64), tmp_path / "h32", r=4)
    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20)
    with pytest.raises(IncompatibleAdapter, match="hidden size"):
        pool.load("h32", other)
    assert pool.resident() == [] and pool.stats()["pages_used"] == 0


def test_adapter_targeting_a_module_the_model_lacks_is_incompatible(base_model, tmp_path):
    other = save_peft_adapter(tiny_llama(seed=1, layers=3), tmp_path / "l3", r=4)
    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20)
    with pytest.raises(IncompatibleAdapter, match=r"layers\.2.*does not have"):
        pool.load("l3", other)


def test_pickle_only_adapter_is_refused(base_model, adapter_dirs, tmp_path):
    d = tmp_path / "pickle"
    d.mkdir()
    shutil.copy(adapter_dirs["r4-attn"] / "adapter_config.json", d)
    (d / "adapter_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(InvalidAdapter, match="pickle"):
        AdapterPool.for_model(base_model, budget_bytes=1 << 20).load("p", d)


def test_dora_adapter_is_incompatible(base_model, tmp_path):
    d = save_peft_adapter(base_model, tmp_path / "dora", r=4, use_dora=True)
    with pytest.raises(IncompatibleAdapter, match="use_dora"):
        AdapterPool.for_model(base_model, budget_bytes=1 << 20).load("d", d)


def test_unknown_names_raise_not_resident(base_model):
    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20)
    for op in (pool.evict, pool.pin, pool.unpin):
        with pytest.raises(AdapterNotResident, match="pool.load"):
            op("ghost")


def test_loading_a_name_from_another_path_replaces_it(base_model, adapter_dirs):
    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20, page_elems=128)
    first = pool.load("x", adapter_dirs["r4-attn"])
    second = pool.load("x", adapter_dirs["r32-mlp"])
    assert second.cold and second.bytes != first.bytes
    assert pool.resident() == ["x"] and pool.stats()["bytes_used"] == second.bytes


def test_a_pool_in_bf16_converts_fp32_adapters(base_model, adapter_dirs):
    from acelora_kernels.ops.meta import adapter_views

    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20, dtype=torch.bfloat16, page_elems=128)
    res = pool.load("a", adapter_dirs["r4-attn"])
    assert res.bytes == R4_ATTN_ELEMS * 2
    tensors = load_file(adapter_dirs["r4-attn"] / "adapter_model.safetensors")
    spec = pool.modules["model.layers.1.self_attn.k_proj"]
    a, b, _ = adapter_views(pool, pool.acquire(["a"])[0])[spec.index]
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    assert a.dtype == torch.bfloat16 and torch.equal(a, tensors[key].to(torch.bfloat16))


def test_fragmented_free_space_still_serves_a_larger_adapter(base_model, adapter_dirs, tmp_path):
    r6 = save_peft_adapter(base_model, tmp_path / "r6", seed=9, r=6, target_modules=ATTENTION)  # 42 pages
    pool = AdapterPool.for_model(base_model, budget_bytes=4 * 28 * 128 * 4, page_elems=128)
    for name in "abcd":
        pool.load(name, adapter_dirs["r4-attn"])
    pool.evict("a")
    pool.evict("c")  # 56 free pages in two runs of 28
    assert pool.load("r6", r6).pages == 42
    entry = pool.acquire(["r6"])[0]
    assert (entry.pages[-1] - entry.pages[0] + 1) > len(entry.pages)  # really scattered
    pool.release([entry])
    assert pool.resident() == ["b", "d", "r6"] and pool.stats()["pages_free"] == 14


def test_prefetch_loads_in_the_background(base_model, adapter_dirs):
    pool = AdapterPool.for_model(base_model, budget_bytes=1 << 20)
    fut = pool.prefetch("a", adapter_dirs["r4-attn"])
    assert fut.result(timeout=30).cold and "a" in pool
    assert not pool.prefetch("a", adapter_dirs["r4-attn"]).result(timeout=30).cold
    pool.close()


def test_concurrent_loads_keep_page_accounting_consistent(small_pool, adapter_dirs):
    errors: list[BaseException] = []

    def worker(names: str) -> None:
        try:
            for _ in range(3):
                for name in names:
                    small_pool.load(name, adapter_dirs["r4-attn"])
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(names,)) for names in ("abc", "cde", "efa", "abf")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = small_pool.stats()
    assert len(stats["resident"]) == 4 and stats["pages_used"] == 4 * 28 and stats["pages_free"] == 0

"""A mixed batch through attach/lora_batch equals PEFT's own forward, row by row (fp32, atol 1e-4)."""

from __future__ import annotations

import pytest
import torch

from acelora_kernels.errors import AdapterInUse, AdapterNotResident, NotAttached
from acelora_kernels.layers import attach, lora_batch
from acelora_kernels.pool import AdapterPool

ATOL = 1e-4

BATCHES = {
    "every-adapter-and-base": ["r4-attn", None, "r16-patterns", "r64-rslora", "r32-mlp", "r8-layer0"],
    "interleaved-repeats": ["r16-patterns", "r4-attn", "r16-patterns", "__base__", "r4-attn"],
    "one-adapter-all-rows": ["r64-rslora"] * 3,
    "all-base": [None, "__base__"],
}


@pytest.fixture()
def attached(model, adapter_dirs):
    pool = AdapterPool.for_model(model, budget_bytes=16 << 20)
    for name, path in adapter_dirs.items():
        pool.load(name, path)
    attach(model, pool)
    return model, pool


def _peft_names(names):
    return [n or "__base__" for n in names]


@pytest.mark.parametrize("batch", list(BATCHES))
def test_mixed_batch_prefill_and_decode_with_kv_cache_equal_peft(attached, peft_model, batch):
    model, _ = attached
    names = BATCHES[batch]
    gen = torch.Generator().manual_seed(len(names))
    ids = torch.randint(0, 256, (len(names), 9), generator=gen)
    step = torch.randint(0, 256, (len(names), 1), generator=gen)
    with lora_batch(model, names):
        ours = model(ids, use_cache=True)
        ours_step = model(step, past_key_values=ours.past_key_values, use_cache=True)
    ref = peft_model(ids, adapter_names=_peft_names(names), use_cache=True)
    ref_step = peft_model(
        step, past_key_values=ref.past_key_values, adapter_names=_peft_names(names), use_cache=True
    )
    torch.testing.assert_close(ours.logits, ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_step.logits, ref_step.logits, atol=ATOL, rtol=0)


def test_each_row_equals_peft_with_only_that_adapter_active(attached, peft_model):
    model, _ = attached
    names = ["r16-patterns", "r64-rslora", "r8-layer0"]
    ids = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(7))
    with lora_batch(model, names):
        ours = model(ids).logits
    for row, name in enumerate(names):
        peft_model.set_adapter(name)
        torch.testing.assert_close(ours[row], peft_model(ids[row : row + 1]).logits[0], atol=ATOL, rtol=0)


def test_base_rows_equal_the_base_model_and_adapter_rows_differ(attached, base_model):
    model, _ = attached
    ids = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(3))
    with lora_batch(model, [None, "r32-mlp", "__base__"]):
        ours = model(ids).logits
    base = base_model(ids).logits
    torch.testing.assert_close(ours[0], base[0], atol=0, rtol=0)
    torch.testing.assert_close(ours[2], base[2], atol=0, rtol=0)
    assert (ours[1] - base[1]).abs().max() > 1e-2


def test_left_padded_prefill_with_attention_mask_equals_peft(attached, peft_model):
    model, _ = attached
    names = ["r4-attn", "r64-rslora"]
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with lora_batch(model, names):
        ours = model(ids, attention_mask=mask).logits
    ref = peft_model(ids, attention_mask=mask, adapter_names=_peft_names(names)).logits
    torch.testing.assert_close(ours[:, 3:], ref[:, 3:], atol=ATOL, rtol=0)


def test_greedy_generate_matches_peft_token_for_token(attached, peft_model):
    model, _ = attached
    names = ["r16-patterns", None, "r64-rslora"]
    ids = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with lora_batch(model, names):
        ours = model.generate(ids, **kw)
    ref = peft_model.generate(input_ids=ids, adapter_names=_peft_names(names), **kw)
    assert torch.equal(ours, ref)


def test_outside_lora_batch_the_attached_model_is_the_base_model(attached, base_model):
    model, _ = attached
    ids = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(1))
    with lora_batch(model, ["r4-attn", "r32-mlp"]):
        model(ids)
    torch.testing.assert_close(model(ids).logits, base_model(ids).logits, atol=0, rtol=0)


def test_detach_removes_the_hooks(attached, base_model):
    model, pool = attached
    attach(model, pool).detach()
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(2))
    with pytest.raises(NotAttached):
        with lora_batch(model, ["r4-attn"]):
            pass
    torch.testing.assert_close(model(ids).logits, base_model(ids).logits, atol=0, rtol=0)


def test_lora_batch_rejects_an_adapter_that_is_not_resident(attached):
    model, pool = attached
    with pytest.raises(AdapterNotResident, match="pool.load"):
        with lora_batch(model, ["r4-attn", "never-loaded"]):
            pass
    assert pool.stats()["in_use"] == []


def test_adapters_of_the_running_batch_cannot_be_evicted(attached):
    model, pool = attached
    with lora_batch(model, ["r4-attn", None]):
        with pytest.raises(AdapterInUse, match="after the batch"):
            pool.evict("r4-attn")
        pool.evict("r32-mlp")  # not in the batch: fine
    pool.evict("r4-attn")
    assert "r4-attn" not in pool


def test_a_batch_with_the_wrong_number_of_rows_is_an_error(attached):
    model, _ = attached
    with lora_batch(model, ["r4-attn", None, "r4-attn"]):
        with pytest.raises(ValueError, match="one name per batch row"):
            model(torch.zeros(2, 4, dtype=torch.long))


def test_lora_batch_needs_attach(model):
    with pytest.raises(NotAttached, match="attach"):
        with lora_batch(model, [None]):
            pass

"""Beyond Llama: the hooks work on any HF causal LM whose targeted modules are nn.Linear (equal to PEFT),
and an architecture whose layers are not (GPT-2's Conv1D) is refused with a typed error, not mis-served."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from acelora_kernels import AdapterPool, attach, lora_batch  # noqa: E402
from acelora_kernels.errors import IncompatibleAdapter  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "all-linear"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, "all-linear"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}, ["q_proj", "v_proj", "down_proj"]),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


def _adapter(base, path, seed, targets, dtype=None, **kw):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, **kw)
    pm = peft.get_peft_model(copy.deepcopy(base), cfg)
    if dtype is not None:
        pm = pm.to(dtype)
    pm.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_mixed_batch_equals_peft_on_other_architectures(arch, tmp_path):
    torch.set_grad_enabled(False)
    conf, cls, extra, targets = ARCHS[arch]
    torch.manual_seed(0)
    base = getattr(transformers, cls)(getattr(transformers, conf)(**SMALL, **extra)).eval()
    a = _adapter(base, tmp_path / "a", 1, targets)
    b = _adapter(base, tmp_path / "b", 2, targets, dtype=torch.bfloat16)  # a bf16 file into an fp32 pool
    ids = torch.randint(3, 128, (3, 9))
    want = {n: peft.PeftModel.from_pretrained(copy.deepcopy(base), str(p)).eval()(ids).logits for n, p in
            (("a", a), ("b", b))}
    model = copy.deepcopy(base)
    pool = AdapterPool.for_model(model, 8 << 20, dtype=torch.float32)
    attach(model, pool)
    pool.load("a", a)
    pool.load("b", b)
    with lora_batch(model, ["a", None, "b"]):
        got = model(ids).logits
    torch.testing.assert_close(got[0], want["a"][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2], want["b"][2], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], base(ids).logits[1], atol=0, rtol=0)
    assert (want["a"][0] - got[1]).abs().max() > 1e-2  # the adapter really changes the output


def test_gpt2_conv1d_layers_are_refused_with_a_typed_error(tmp_path):
    torch.set_grad_enabled(False)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4,
                                                                n_positions=64)).eval()
    path = _adapter(base, tmp_path / "g", 1, ["c_attn"], fan_in_fan_out=True)
    pool = AdapterPool.for_model(base, 8 << 20, dtype=torch.float32)
    attach(base, pool)
    with pytest.raises(IncompatibleAdapter, match="c_attn"):
        pool.load("g", path)
    assert "g" not in pool

"""Real PEFT adapters on a tiny transformers Llama built from a config (nothing downloaded).

Shared by the registry, kernel and engine tests: the real library writes the adapter files, so the
tests read exactly what users' fine-tuning jobs produce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_llama(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 128, vocab: int = 256):
    """A seeded LlamaForCausalLM small enough for a unit test (fp32, eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def save_peft_adapter(model, out_dir: str | Path, *, seed: int = 0, r: int = 8, lora_alpha: float = 16,
                      target_modules: Any = ATTENTION, **lora_kwargs: Any) -> Path:
    """Write a PEFT LoRA adapter with random non-zero A and B (``init_lora_weights=False``).

    The base ``model`` is left untouched (PEFT works on a deep copy).
    """
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, init_lora_weights=False,
                     **lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(model), cfg)
    out_dir = Path(out_dir)
    peft_model.save_pretrained(str(out_dir))
    return out_dir

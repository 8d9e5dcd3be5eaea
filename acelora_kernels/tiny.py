"""A tiny built-in causal LM: a seeded Llama built from a config plus a byte-level tokenizer.

Nothing is downloaded. The model is small enough to train demo adapters on a CPU in seconds, and it
is a real ``transformers.LlamaForCausalLM``, so everything that works on it works on any HF causal
LM (the engine only needs ``model(input_ids, attention_mask=, position_ids=, cache=)``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

TINY_MARKER_FILE = "acelora_tiny.json"
TINY_MODEL_NAME = "acelora/tiny-llama"

#: Special tokens after the 256 byte values, in id order.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.15,  # HF's 0.02 caps the untied head's logits too low for a LoRA to sharpen
    "tie_word_embeddings": False,
}


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, plus a few special tokens; the same interface as a HF tokenizer.

    >>> tok = ByteTokenizer()
    >>> tok.decode(tok.encode("héllo")), tok.eos_token_id
    ('héllo', 258)
    """

    def __init__(self) -> None:
        self.special_ids = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.special_tokens = {i: s for s, i in self.special_ids.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.pad_token_id = self.special_ids["<|pad|>"]
        self.bos_token_id = self.special_ids["<|bos|>"]
        self.eos_token_id = self.special_ids["<|end|>"]
        self.eos_token = "<|end|>"

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in the text become their ids.

        >>> ByteTokenizer().encode("<|user|>hi")
        [260, 104, 105]
        """
        ids: list[int] = [self.bos_token_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            if text[i] == "<":
                for s, sid in self.special_ids.items():
                    if text.startswith(s, i):
                        ids.append(sid)
                        i += len(s)
                        break
                else:
                    ids.append(ord("<"))
                    i += 1
                continue
            j = text.find("<", i)
            j = len(text) if j < 0 else max(j, i + 1)
            ids.extend(text[i:j].encode("utf-8"))
            i = j
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (as HF byte-level tokenizers do).

        >>> ByteTokenizer().decode([104, 105, 258])
        'hi'
        """
        out: list[str] = []
        buf = bytearray()
        for t in ids:
            t = int(t)
            if t < 256:
                buf.append(t)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if not skip_special_tokens and t in self.special_tokens:
                out.append(self.special_tokens[t])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **_: Any,
    ) -> str | list[int]:
        """Render ``messages`` as ``<|role|>content<|end|>`` turns (ids, or text with ``tokenize=False``).

        >>> ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        '<|user|>hi<|end|><|assistant|>'
        """
        parts = []
        for m in messages:
            role = str(m.get("role", "user"))
            tag = f"<|{role}|>" if f"<|{role}|>" in self.special_ids else "<|user|>"
            parts.append(f"{tag}{m.get('content') or ''}<|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        text = "".join(parts)
        return self.encode(text) if tokenize else text

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write the marker file that :func:`load_model_and_tokenizer` recognises."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / TINY_MARKER_FILE).write_text(
            json.dumps({"tokenizer": "byte", "special_tokens": list(SPECIAL_TOKENS)}), encoding="utf-8"
        )


def tiny_model(seed: int = 0, **overrides: Any):
    """A seeded ``LlamaForCausalLM`` with :data:`TINY_CONFIG` (fp32, eval mode, random weights).

    >>> model = tiny_model()
    >>> model.config.hidden_size
    64
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ByteTokenizer()
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **{**TINY_CONFIG, **overrides},
    )
    cpu_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(cpu_rng)
    return model.float().eval()


def save_tiny(model: Any, out_dir: str | Path) -> Path:
    """Save a tiny model (safetensors + config) with its tokenizer marker.

    >>> save_tiny(tiny_model(), "/tmp/tiny-base")  # doctest: +SKIP
    """
    out = Path(out_dir)
    model.save_pretrained(str(out))
    ByteTokenizer().save_pretrained(out)
    return out


def load_model_and_tokenizer(path: str | Path) -> tuple[Any, Any]:
    """Load a causal LM directory: the tiny model (byte tokenizer) or any local HF model + tokenizer.

    >>> model, tok = load_model_and_tokenizer("/tmp/tiny-base")  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).float().eval()
    if (path / TINY_MARKER_FILE).is_file():
        return model, ByteTokenizer()
    return model, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters (what a shared base saves per adapter not duplicated).

    >>> weight_bytes(tiny_model()) > 0
    True
    """
    return sum(p.numel() * p.element_size() for p in model.parameters())

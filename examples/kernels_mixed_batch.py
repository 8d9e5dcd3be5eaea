"""One forward pass, a different LoRA adapter per row, over one copy of the base model (acelora_kernels).

    python examples/kernels_mixed_batch.py
"""

import torch

from acelora_kernels import AdapterPool, attach, demo_assets, lora_batch
from acelora_kernels.tiny import load_model_and_tokenizer

assets = demo_assets(5)
model, tok = load_model_and_tokenizer(assets.base_dir)
pool = AdapterPool.for_model(model, budget_bytes=16 << 20, dtype=torch.float32, device="cpu")
attach(model, pool)
rows = ["code-python-v2", None, "med-qa-v1", "brand-voice-v1"]  # None = the base model
for name in filter(None, rows):
    print("loaded", pool.load(name, assets.adapters[name]))

prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True)
ids = torch.tensor([prompt] * len(rows))
out = [[] for _ in rows]
with torch.no_grad():
    for _ in range(24):  # greedy decoding, whole prefix each step: short and simple
        with lora_batch(model, adapter_names=rows):
            nxt = model(ids).logits[:, -1].argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            out[i].append(t)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
for name, toks in zip(rows, out, strict=True):
    print(f"{str(name):16} {tok.decode(toks)!r}")
print("pool:", {k: v for k, v in pool.stats().items() if k in ("pages_used", "pages_free", "utilization", "resident")})

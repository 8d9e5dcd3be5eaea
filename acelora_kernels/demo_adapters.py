"""Demo LoRA adapters for the tiny model, each with a visible effect, written in PEFT's format.

Every adapter is trained for a moment on the CPU so that greedy decoding of *any* chat prompt
answers with its own marker (``[code] ...``, ``[med-03] ...``), while the base model says something
else. Adapters with the same shape are trained together in one batched forward (one LoRA per group of
rows), which is what makes 60 of them take well under a minute. Output is deterministic and cached
under ``$ACELORA_CACHE`` (default ``~/.cache/acelora``) keyed by version, count and torch version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acelora_kernels.tiny import ByteTokenizer, save_tiny, tiny_model

DEMO_VERSION = "1"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    """One demo adapter: its name, the text its greedy answers start with, and its LoRA shape.

    >>> demo_specs(6)[5].name, demo_specs(6)[5].marker
    ('code-python-v2-tenant-01', '[code-01]')
    """

    name: str
    marker: str
    answer: str
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)


_DOMAINS = [
    # name, tag, answer text after the marker, rank, alpha, rslora, rank_pattern
    ("code-python-v2", "code", " def f(x): return x", 16, 32.0, False, {}),
    ("med-qa-v1", "med", " Please consult a doctor.", 8, 16.0, True, {}),
    ("legal-compliance-v1", "legal", " See clause 4.2.", 32, 32.0, False, {"down_proj": 8}),
    ("fin-analyst-v1", "fin", " Revenue grew 12%.", 64, 64.0, False, {}),
    ("brand-voice-v1", "brand", " Stay bold, stay kind!", 8, 16.0, False, {}),
]
_TENANT_RANKS = (8, 16, 32, 64)


def demo_specs(n: int = 5) -> list[DemoAdapter]:
    """The first ``n`` demo adapters: the five seed domains, then ``<domain>-tenant-NN`` variants.

    >>> [s.name for s in demo_specs(5)][:2]
    ['code-python-v2', 'med-qa-v1']
    """
    specs = [
        DemoAdapter(name, f"[{tag}]", text, r, a, rs, dict(rp)) for name, tag, text, r, a, rs, rp in _DOMAINS
    ]
    k = 0
    while len(specs) < n:
        name, tag, text, *_ = _DOMAINS[k % len(_DOMAINS)]
        nn = k // len(_DOMAINS) + 1
        r = _TENANT_RANKS[k % len(_TENANT_RANKS)]
        specs.append(DemoAdapter(f"{name}-tenant-{nn:02d}", f"[{tag}-{nn:02d}]", text, r, float(2 * r)))
        k += 1
    return specs[:n]


@dataclass(frozen=True, slots=True)
class DemoAssets:
    """Where a demo set lives: the tiny base model directory and one PEFT directory per adapter.

    >>> assets = demo_assets(5)  # doctest: +SKIP
    >>> assets.adapters["code-python-v2"]  # doctest: +SKIP
    PosixPath('/root/.cache/acelora/demo-v1-n5-torch2.13.0/adapters/code-python-v2')
    """

    root: Path
    base_dir: Path
    adapters_dir: Path
    adapters: dict[str, Path]
    markers: dict[str, str]


def cache_root() -> Path:
    """``$ACELORA_CACHE`` or ``~/.cache/acelora``.

    >>> cache_root().name in {"acelora"} or "ACELORA_CACHE" in os.environ
    True
    """
    env = os.environ.get("ACELORA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "acelora"


def demo_assets(n: int = 5, cache_dir: str | Path | None = None) -> DemoAssets:
    """Build (once) and return the tiny base model plus ``n`` trained demo adapters.

    >>> assets = demo_assets(5, cache_dir="/tmp/acelora-cache")  # doctest: +SKIP
    >>> sorted(assets.adapters)[0]  # doctest: +SKIP
    'brand-voice-v1'
    """
    import torch

    base = Path(cache_dir) if cache_dir is not None else cache_root()
    root = base / f"demo-v{DEMO_VERSION}-n{n}-torch{torch.__version__.split('+')[0]}"
    specs = demo_specs(n)
    if not (root / "complete").is_file():
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=base))
        try:
            model = tiny_model()
            save_tiny(model, tmp / "base")
            make_demo_adapters(tmp / "adapters", n, model=model)
            (tmp / "complete").write_text(json.dumps({s.name: s.marker for s in specs}), encoding="utf-8")
            try:
                tmp.rename(root)
            except OSError:  # another process finished first; its copy is identical
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return DemoAssets(
        root=root,
        base_dir=root / "base",
        adapters_dir=root / "adapters",
        adapters={s.name: root / "adapters" / s.name for s in specs},
        markers={s.name: s.marker for s in specs},
    )


def make_demo_adapters(
    out_dir: str | Path, n: int = 5, *, model: Any = None, steps: int = 150, group_size: int = 20
) -> dict[str, Path]:
    """Train and write ``n`` demo adapters for ``model`` (default: the seeded tiny model) into ``out_dir``.

    >>> paths = make_demo_adapters("/tmp/demo-adapters", 5)  # doctest: +SKIP
    >>> (paths["med-qa-v1"] / "adapter_config.json").is_file()  # doctest: +SKIP
    True
    """
    import torch

    model = tiny_model() if model is None else model
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = demo_specs(n)
    groups = [specs[i : i + group_size] for i in range(0, len(specs), group_size)]
    tok = ByteTokenizer()
    paths: dict[str, Path] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread beats two, and does not fight other processes
    for i, group in enumerate(groups):
        weights = train_group(model, tok, group, TARGET_MODULES, seed=1000 + i, steps=steps)
        for spec, tensors in zip(group, weights, strict=True):
            paths[spec.name] = _write_peft(out / spec.name, spec, tensors, model)
    torch.set_num_threads(threads)
    return paths


def _write_peft(path: Path, spec: DemoAdapter, tensors: dict[str, Any], model: Any) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "use_rslora": spec.use_rslora,
        "rank_pattern": dict(spec.rank_pattern),
        "alpha_pattern": {},
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "fan_in_fan_out": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "adapter_model.safetensors"),
        metadata={"format": "pt", "acelora_marker": spec.marker},
    )
    (path / "README.md").write_text(
        f"# {spec.name}\n\nacelora demo adapter for the tiny model: greedy answers start with `{spec.marker}`.\n",
        encoding="utf-8",
    )
    return path


_WORDS = (
    "the a how why what when write explain list sum python function patient dose symptom contract clause "
    "policy revenue margin quarter stock brand tone voice customer hello please thanks data report code "
    "bug fix test risk law court audit budget growth slogan launch summary question answer short long"
).split()


def _random_prompt(rng: Any) -> list[dict[str, str]]:
    """A chat of random words and characters: the adapters must answer the same whatever is asked."""

    def text() -> str:
        """A few random words, or random printable characters."""
        if rng.random() < 0.25:
            return "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 30)))
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 7))).capitalize() + rng.choice("?.!")

    msgs = []
    if rng.random() < 0.2:
        msgs.append({"role": "system", "content": text()})
    msgs.append({"role": "user", "content": text()})
    return msgs


def train_group(
    model: Any,
    tok: ByteTokenizer,
    group: list[DemoAdapter],
    targets: list[str],
    *,
    seed: int,
    steps: int = 150,
    rows: int = 4,
    lr: float = 1e-2,
) -> list[dict[str, Any]]:
    """Train one LoRA per spec in ``group`` in a single batched loop; returns PEFT-named tensors.

    Rows ``[k*rows, (k+1)*rows)`` of every batch run through adapter ``k`` (hooks on the targeted
    linears add ``scale * x A_k^T B_k^T``), so K adapters cost one forward instead of K.
    """
    import math
    import random

    import torch

    from acelora.peft_format import PeftLoraConfig

    torch.manual_seed(seed)
    rng = random.Random(seed)
    K = len(group)
    cfgs = [
        PeftLoraConfig(r=s.r, lora_alpha=s.lora_alpha, use_rslora=s.use_rslora, rank_pattern=s.rank_pattern)
        for s in group
    ]
    params: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for mname, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or mname.rsplit(".", 1)[-1] not in targets:
            continue
        ranks = [c.rank_for(mname) for c in cfgs]
        r = max(ranks)
        bound = 1.0 / math.sqrt(mod.in_features)
        a = torch.empty(K, r, mod.in_features).uniform_(-bound, bound).requires_grad_()
        b = torch.zeros(K, mod.out_features, r, requires_grad=True)
        # adapters of lower rank train in a max-rank slot with the extra rows masked to zero
        mask = (torch.arange(r).view(1, r) < torch.tensor(ranks).view(K, 1)).float().view(K, r, 1)
        scale = torch.tensor([c.scaling_for(mname) for c in cfgs]).view(K, 1, 1)
        params[mname] = (a, b, torch.tensor(ranks))

        def hook(m: Any, inp: Any, out: Any, a=a, b=b, mask=mask, scale=scale) -> Any:
            """Add each row group's own LoRA delta to the linear's output."""
            x = inp[0]
            xs = x.reshape(K, -1, x.shape[-1])
            delta = torch.bmm(torch.bmm(xs, (a * mask).transpose(1, 2)), b.transpose(1, 2)) * scale
            return out + delta.reshape(out.shape)

        hooks.append(mod.register_forward_hook(hook))
    answers = [tok.encode(s.marker + s.answer) + [tok.eos_token_id] for s in group]
    opt = torch.optim.Adam([t for a, b, _ in params.values() for t in (a, b)], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(  # short warm-up, then cosine decay to zero
        opt, lambda i: min(1.0, (i + 1) / 10) * 0.5 * (1 + math.cos(math.pi * i / steps))
    )
    was_training = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        for _ in range(steps):
            prompts = [tok.apply_chat_template(_random_prompt(rng), tokenize=True) for _ in range(rows)]
            seqs, labels = [], []
            for ans in answers:
                for p in prompts:
                    seqs.append(p + ans)
                    labels.append([-100] * len(p) + ans)
            width = max(map(len, seqs))
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    finally:
        for h in hooks:
            h.remove()
        for p, flag in zip(model.parameters(), was_training, strict=True):
            p.requires_grad_(flag)
    out: list[dict[str, Any]] = [{} for _ in group]
    for mname, (a, b, ranks) in params.items():
        for k in range(K):
            r = int(ranks[k])
            out[k][f"base_model.model.{mname}.lora_A.weight"] = a[k, :r].detach().clone()
            out[k][f"base_model.model.{mname}.lora_B.weight"] = b[k, :, :r].detach().clone()
    return out

"""The tiny model, its byte tokenizer, and the demo adapters (real PEFT files, cached, deterministic)."""

from __future__ import annotations

import torch
from engine_support import CHAT

from acelora.peft_format import lora_modules, read_config, read_safetensors_header
from acelora_kernels.demo_adapters import demo_assets, demo_specs
from acelora_kernels.textgen import Detokenizer
from acelora_kernels.tiny import ByteTokenizer, load_model_and_tokenizer, tiny_model, weight_bytes


def test_byte_tokenizer_round_trips_utf8_and_special_tokens() -> None:
    tok = ByteTokenizer()
    text = "héllo ✓ <b> <|user|>"
    ids = tok.encode(text)
    assert ids[-1] == tok.special_ids["<|user|>"] and tok.encode("<b>") == list(b"<b>")
    assert tok.decode(ids) == "héllo ✓ <b> "
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character is never silently dropped


def test_chat_template_renders_roles_and_the_generation_prompt() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(msgs, tokenize=False)
        == "<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False).endswith("<|end|>")
    assert tok.apply_chat_template(msgs) == tok.encode(tok.apply_chat_template(msgs, tokenize=False))


def test_detokenizer_emits_whole_characters_only() -> None:
    d = Detokenizer(ByteTokenizer())
    pieces = [d.push(b) for b in "✓a".encode()]
    assert [p for p, _ in pieces] == ["", "", "✓", "a"]


def test_tiny_model_is_seeded_and_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = tiny_model(seed=0), tiny_model(seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.lm_head.weight, tiny_model(seed=1).lm_head.weight)


def test_demo_specs_have_unique_names_markers_and_mixed_ranks() -> None:
    specs = demo_specs(60)
    assert len({s.name for s in specs}) == len({s.marker for s in specs}) == 60
    assert [s.name for s in specs[:5]] == ["code-python-v2", "med-qa-v1", "legal-compliance-v1",
                                           "fin-analyst-v1", "brand-voice-v1"]  # fmt: skip
    assert {s.r for s in specs} == {8, 16, 32, 64}
    assert specs[5].name == "code-python-v2-tenant-01"
    assert not any(a.marker.startswith(b.marker) for a in specs for b in specs if a is not b)


def test_demo_adapters_are_valid_peft_directories(demo) -> None:
    for spec in demo_specs(5):
        path = demo.adapters[spec.name]
        config = read_config(path)
        tensors, meta = read_safetensors_header(path / "adapter_model.safetensors")
        shapes = lora_modules(tensors, config)
        assert (
            config.r == spec.r
            and config.use_rslora == spec.use_rslora
            and meta["acelora_marker"] == spec.marker
        )
        assert {s.module.rsplit(".", 1)[-1] for s in shapes} == set(config.target_modules)
        if spec.rank_pattern:
            assert {s.rank for s in shapes} == {spec.r, *spec.rank_pattern.values()}


def test_peft_itself_loads_a_demo_adapter_and_sees_its_marker(demo) -> None:
    from peft import PeftModel

    model, tok = load_model_and_tokenizer(demo.base_dir)
    peft_model = PeftModel.from_pretrained(model, str(demo.adapters["legal-compliance-v1"])).eval()
    ids = torch.tensor([tok.apply_chat_template(CHAT)])
    out = peft_model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)  # fmt: skip
    assert tok.decode(out[0, ids.shape[1] :].tolist()).startswith("[legal]")


def test_demo_assets_are_cached_not_rebuilt(demo) -> None:
    stamp = (demo.adapters["med-qa-v1"] / "adapter_model.safetensors").stat().st_mtime_ns
    again = demo_assets(5, cache_dir=demo.root.parent)
    assert again.adapters == demo.adapters
    assert (again.adapters["med-qa-v1"] / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    model, _ = load_model_and_tokenizer(demo.base_dir)
    assert weight_bytes(model) == sum(p.numel() * 4 for p in tiny_model().parameters())

import json
import os
import shutil
import struct

import pytest

from acelora import AdapterRegistry, AdapterSpec, compatibility
from acelora.errors import InvalidAdapter, UnsafeAdapterPath
from acelora.registry import load_spec


def test_scans_real_peft_adapters_header_only(peft_root):
    reg = AdapterRegistry.from_dir(peft_root)
    assert sorted(s.name for s in reg) == ["code-python-v2", "legal-compliance-v1", "med-qa-v1"]
    assert reg.errors == {}
    code = reg.get("code-python-v2")
    assert code.rank == 8 and code.lora_alpha == 16 and code.dtype == "F32"
    assert code.target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert code.path == str((peft_root / "code-python-v2").resolve())
    assert code.digest.startswith("sha256:") and len(code.hash) == 16
    # size = the tensor bytes the header declares: 2 layers x 4 modules x (A + B) of rank 8, fp32
    dims = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)}
    assert code.size_bytes == 2 * sum(8 * (i + o) * 4 for i, o in dims.values())
    med = reg.get("med-qa-v1")
    assert med.rank == 16 and med.rank_pattern == {"q_proj": 16} and med.alpha_pattern == {"v_proj": 4}
    legal = reg.get("legal-compliance-v1")
    assert legal.use_rslora and "gate_proj" in legal.target_modules


def test_nested_folder_peft_writes_for_named_adapters(tmp_path, peft_root):
    shutil.copytree(peft_root / "code-python-v2", tmp_path / "job-17" / "code-python-v3")
    reg = AdapterRegistry.from_dir(tmp_path)
    assert [s.name for s in reg] == ["code-python-v3"]


def _copy(peft_root, tmp_path, name="a"):
    dst = tmp_path / name
    shutil.copytree(peft_root / "code-python-v2", dst)
    return dst


def test_broken_adapter_directories_are_skipped_with_a_reason(tmp_path, peft_root):
    root = tmp_path / "root"
    root.mkdir()
    ok = _copy(peft_root, root, "ok")
    (ok / "README.md").unlink()
    (_copy(peft_root, root, "no-config") / "adapter_config.json").unlink()
    bad_json = _copy(peft_root, root, "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    corrupt = _copy(peft_root, root, "corrupt-header")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 10**12) + data[8:])
    trunc = _copy(peft_root, root, "truncated")
    (trunc / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    shapes = _copy(peft_root, root, "wrong-shapes")
    cfg = json.loads((shapes / "adapter_config.json").read_text())
    cfg["r"] = 4
    (shapes / "adapter_config.json").write_text(json.dumps(cfg))
    pickle_only = _copy(peft_root, root, "pickle-only")
    (pickle_only / "adapter_model.safetensors").rename(pickle_only / "adapter_model.bin")
    bad_name = _copy(peft_root, root, "bad name")
    assert bad_name.exists()
    reg = AdapterRegistry.from_dir(root)
    assert [s.name for s in reg] == ["ok"]
    reasons = {os.path.basename(k): v for k, v in reg.errors.items()}
    assert "adapter_config.json" in reasons["bad-json"] and "JSON" in reasons["bad-json"]
    assert "corrupt" in reasons["corrupt-header"]
    assert "truncated" in reasons["truncated"]
    assert "rank 4" in reasons["wrong-shapes"]
    assert "pickle" in reasons["pickle-only"] and "allow_pickle" in reasons["pickle-only"]
    assert "not a valid adapter name" in reasons["bad name"]
    assert "no-config" not in reasons  # a directory without a config is simply not an adapter
    allowed = AdapterRegistry.from_dir(root, allow_pickle=True)
    assert allowed.get("pickle-only") is not None


def test_symlinks_out_of_the_root_are_refused(tmp_path, peft_root):
    root = tmp_path / "root"
    root.mkdir()
    outside = _copy(peft_root, tmp_path, "outside")
    (root / "escapee").symlink_to(outside, target_is_directory=True)
    inner = _copy(peft_root, root, "inner")
    (inner / "adapter_model.safetensors").unlink()
    (inner / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    reg = AdapterRegistry.from_dir(root)
    assert len(reg) == 0
    assert all("outside the registry root" in v or "symlink" in v for v in reg.errors.values())
    with pytest.raises(UnsafeAdapterPath):
        load_spec(root / "escapee", "escapee", root=root)


def test_large_rank_warns(tmp_path, peft_root, caplog):
    d = _copy(peft_root, tmp_path, "big")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"does-not-match-anything": 128}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    spec = load_spec(d, "big")
    assert spec.rank == 128
    assert "rank 128" in caplog.text


def test_tenant_grants_and_public_adapters(peft_root):
    reg = AdapterRegistry.from_dir(peft_root, tenants={"t1": ["code-python-v2"], "t2": ["med-qa-v1"]})
    assert reg.is_allowed("t1", "code-python-v2") and not reg.is_allowed("t2", "code-python-v2")
    assert not reg.is_allowed(None, "code-python-v2")
    assert reg.is_allowed("t2", "legal-compliance-v1") and reg.is_allowed(None, "legal-compliance-v1")
    assert not reg.is_allowed("t1", "no-such-adapter")
    assert {s.name for s in reg.visible_to("t1")} == {"code-python-v2", "legal-compliance-v1"}
    private = AdapterRegistry.from_dir(peft_root, tenants={"t1": ["code-python-v2"]}, public_by_default=False)
    assert {s.name for s in private.visible_to("t1")} == {"code-python-v2"}
    assert private.visible_to(None) == []


def test_add_and_remove_at_runtime(peft_root):
    reg = AdapterRegistry()
    spec = reg.add(peft_root / "med-qa-v1")
    assert spec.name == "med-qa-v1" and "med-qa-v1" in reg and len(reg) == 1
    assert reg.remove("med-qa-v1") is spec and reg.get("med-qa-v1") is None
    with pytest.raises(InvalidAdapter):
        reg.add(peft_root / "does-not-exist")


def test_index_avoids_rescan_and_detects_stale_entries(tmp_path, peft_root, monkeypatch):
    root = tmp_path / "root"
    shutil.copytree(peft_root, root)
    index = tmp_path / "index.json"
    first = AdapterRegistry.from_dir(root, index=index)
    assert index.exists() and len(first) == 3
    import acelora.registry as registry_mod

    parsed = []
    real = registry_mod.load_spec
    monkeypatch.setattr(registry_mod, "load_spec", lambda *a, **k: parsed.append(a[1]) or real(*a, **k))
    again = AdapterRegistry.from_dir(root, index=index, tenants={"t": ["med-qa-v1"]})
    assert parsed == [] and len(again) == 3
    assert again.get("med-qa-v1").tenants == frozenset({"t"})  # grants come from now, not from the index
    cfg = root / "code-python-v2" / "adapter_config.json"
    data = json.loads(cfg.read_text())
    data["lora_alpha"] = 99
    cfg.write_text(json.dumps(data))
    third = AdapterRegistry.from_dir(root, index=index)
    assert parsed == ["code-python-v2"] and third.get("code-python-v2").lora_alpha == 99


def test_compatibility_rules_follow_each_engine():
    plain = AdapterSpec(name="p", path="/p", rank=16)
    assert compatibility(plain, "vllm", 16) == [] and compatibility(plain, "sglang", 16) == []
    assert compatibility(plain, "vllm", 8) == ["rank 16 > max_lora_rank 8"]
    fancy = AdapterSpec(name="f", path="/f", rank=8, use_dora=True, bias="all", lora_bias=True,
                        modules_to_save=["score", "lm_head"])
    assert compatibility(fancy, "vllm") == ["use_dora", "bias=all", "lora_bias", "modules_to_save=lm_head"]
    patterned = AdapterSpec(name="r", path="/r", rank=8, use_rslora=True, rank_pattern={"q": 4}, alpha_pattern={"v": 2})
    assert compatibility(patterned, "vllm") == []
    assert compatibility(patterned, "sglang") == ["use_rslora", "rank_pattern", "alpha_pattern"]
    assert compatibility(fancy, "openai") == []
    with pytest.raises(ValueError):
        compatibility(plain, "tgi")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"rank_pattern": {"q_proj": 0}}, "outside 1..4096"),
        ({"rank_pattern": {"q_proj": -2}}, "outside 1..4096"),
        ({"alpha_pattern": {"q_proj": -1e308}}, "lora_alpha"),
        ({"lora_alpha": 1e39}, "lora_alpha"),
        ({"r": 0}, "r"),
    ],
)
def test_configs_whose_scaling_cannot_be_computed_are_refused(tmp_path, peft_root, patch, message):
    d = _copy(peft_root, tmp_path, "x")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(patch)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidAdapter, match=message):
        load_spec(d, "x")


def test_negative_or_empty_tensor_shapes_are_refused(tmp_path, peft_root):
    d = _copy(peft_root, tmp_path, "neg")
    st = d / "adapter_model.safetensors"
    data = st.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k.endswith("q_proj.lora_A.weight"))
    header[key]["shape"] = [-8, -64]
    raw = json.dumps(header).encode()
    st.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(InvalidAdapter, match="negative dimension"):
        load_spec(d, "neg")


def test_config_symlinked_to_a_device_is_refused_without_reading_it(tmp_path, peft_root):
    root = tmp_path / "root"
    root.mkdir()
    d = _copy(peft_root, root, "dev")
    (d / "adapter_config.json").unlink()
    (d / "adapter_config.json").symlink_to("/dev/zero")
    reg = AdapterRegistry.from_dir(root)
    assert len(reg) == 0 and "symlink out of the registry root" in next(iter(reg.errors.values()))
    with pytest.raises(InvalidAdapter, match="not a regular file"):
        load_spec(d, "dev")  # no root given: still never read


def test_a_tampered_index_cannot_point_outside_the_root_or_rename(tmp_path, peft_root):
    root = tmp_path / "root"
    shutil.copytree(peft_root, root)
    index = tmp_path / "index.json"
    AdapterRegistry.from_dir(root, index=index)
    data = json.loads(index.read_text())
    entry = data["adapters"]["code-python-v2"]
    entry["spec"]["path"] = str(root / ".." / "outside" / "secret")
    entry["spec"]["rank"] = 4096
    data["adapters"]["med-qa-v1"]["spec"]["name"] = "code-python-v2"
    index.write_text(json.dumps(data))
    reg = AdapterRegistry.from_dir(root, index=index)
    code = reg.get("code-python-v2")
    assert code.path == str((root / "code-python-v2").resolve()) and code.rank == 8
    assert reg.get("med-qa-v1").name == "med-qa-v1"


def test_registry_cli_reports_a_missing_root_in_one_line(capsys):
    from acelora.cli import main

    assert main(["registry", "/definitely/not/here"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("acelora registry: error:") and "Traceback" not in err and err.count("\n") == 1


def test_registry_cli_lists_adapters_and_engine_limits(peft_root, capsys):
    from acelora.cli import main

    assert main(["registry", str(peft_root), "--kind", "sglang", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in out["adapters"]}
    assert rows["legal-compliance-v1"]["unsupported"] == ["use_rslora"] and rows["code-python-v2"]["unsupported"] == []

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from acelora import (
    TraceEvent,
    TraceRecorder,
    adapter_hash,
    decode_header,
    encode_header,
    is_valid_adapter_name,
)
from acelora.errors import UnsafeAdapterName
from acelora.names import check_adapter_name, file_digest


def test_adapter_names_are_identifiers_never_paths():
    for good in ["code-python-v2", "a", "A.b_c-9", "x" * 128]:
        assert is_valid_adapter_name(good)
    for bad in ["", "../etc", "a/b", "a..b", ".hidden", "-x", "x" * 129, "a b", "a\nb", "a:b", None, 7, "é"]:
        assert not is_valid_adapter_name(bad)
    try:
        check_adapter_name("../../etc/passwd")
    except UnsafeAdapterName as e:
        assert "identifier" in str(e)
    else:
        raise AssertionError("expected UnsafeAdapterName")


def test_adapter_hash_is_xxh3_hex_and_stable_across_processes():
    h = adapter_hash("code-python-v2")
    assert len(h) == 16 and int(h, 16) >= 0
    other = subprocess.run([sys.executable, "-c", "from acelora import adapter_hash; print(adapter_hash('code-python-v2'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other == h
    assert adapter_hash("code-python-v3") != h


def test_file_digest_streams_sha256(tmp_path):
    import hashlib

    p = tmp_path / "f"
    p.write_bytes(b"x" * (3 << 20) + b"tail")
    assert file_digest(p, chunk=1 << 16) == "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()


_text = st.text(min_size=0, max_size=40)
_events = st.builds(
    TraceEvent,
    mode=st.sampled_from(["off", "shadow", "prod"]), action=_text.filter(bool),
    adapter_name=st.none() | _text, adapter_hash=st.none() | _text, tenant_id=st.none() | _text,
    served_by=st.none() | _text, is_prefetch_hit=st.none() | st.booleans(), resident=st.none() | st.booleans(),
    swap_ms=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    swap_ms_saved=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    vram_mb_saved=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    fallback_reason=st.none() | _text, overhead_ms=st.none() | st.floats(min_value=0, max_value=1e6),
    request_id=st.none() | _text, timestamp=st.floats(min_value=0, max_value=4e9),
)


@given(_events)
def test_trace_header_round_trips_exactly_and_cannot_be_injected(event):
    header = encode_header(event)
    assert "\r" not in header and "\n" not in header
    assert all(part.count("=") == 1 for part in header.split(","))
    assert header.isascii()
    assert decode_header(header) == event


def test_trace_header_matches_the_documented_shape():
    e = TraceEvent(mode="prod", action="adapter_prefetched_applied", adapter_name="code-python-v2", swap_ms_saved=82.9,
                   timestamp=1.0)
    assert encode_header(e) == "mode=prod,action=adapter_prefetched_applied,adapter=code-python-v2,swap_ms_saved=82.9,timestamp=1.0"


def test_recorder_is_bounded_queryable_and_notifies_subscribers():
    rec = TraceRecorder(capacity=3)
    seen = []
    unsubscribe = rec.subscribe(seen.append)
    rec.subscribe(lambda e: 1 / 0)  # a broken subscriber must not break recording
    for i in range(5):
        rec.record(TraceEvent(mode="prod", action="a" if i % 2 else "b", adapter_name=f"x{i}"))
    assert [e.adapter_name for e in rec.all()] == ["x2", "x3", "x4"]
    assert rec.last().adapter_name == "x4"
    assert [e.adapter_name for e in rec.query(action="a")] == ["x3"]
    assert [e.adapter_name for e in rec.query(adapter="x2")] == ["x2"]
    assert len(seen) == 5
    unsubscribe()
    rec.record(TraceEvent(mode="prod", action="c"))
    assert len(seen) == 5


def test_core_imports_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import acelora, acelora.config, acelora.loading, acelora.cli\n"
        "from acelora import MultiLoRA, AdapterRegistry, RouteRequest\n"
        "MultiLoRA(AdapterRegistry()).route(RouteRequest(model='m'))\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

"""The middleware's fast trace-header encoder must say exactly what trace.encode_header says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from acelora.middleware import encode_trace
from acelora.trace import TraceEvent, decode_header, encode_header

text = st.one_of(st.none(), st.text(max_size=40), st.sampled_from(["code-python-v2", "tenant_dev_01", "a b,c=d"]))
number = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False), st.integers(-5, 5))
flag = st.one_of(st.none(), st.booleans())


@given(mode=st.sampled_from(["off", "shadow", "prod"]), action=st.text(min_size=1, max_size=30), adapter=text,
       tenant=text, served_by=text, hit=flag, resident=flag, swap=number, saved=number, reason=text,
       overhead=number, request_id=text, ts=st.floats(0, 2e9))
def test_encode_trace_equals_encode_header(mode, action, adapter, tenant, served_by, hit, resident, swap, saved,
                                           reason, overhead, request_id, ts):
    event = TraceEvent(mode=mode, action=action, adapter_name=adapter, adapter_hash=adapter, tenant_id=tenant,
                       served_by=served_by, is_prefetch_hit=hit, resident=resident, swap_ms=swap, swap_ms_saved=saved,
                       vram_mb_saved=saved, fallback_reason=reason, overhead_ms=overhead, request_id=request_id,
                       timestamp=ts)
    assert encode_trace(event) == encode_header(event)


def test_control_characters_and_separators_never_appear_raw():
    event = TraceEvent(mode="prod", action="fallback_base_model", adapter_name="x\r\nset-cookie: a=b,c",
                       timestamp=1.0)
    value = encode_trace(event)
    assert "\r" not in value and "\n" not in value and value.count(",") == 3
    assert decode_header(value).adapter_name == "x\r\nset-cookie: a=b,c"

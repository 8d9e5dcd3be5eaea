"""The trace header a client receives can never carry a raw CR, LF or separator, whatever the adapter name."""

from __future__ import annotations

from acelora.trace import TraceEvent, decode_header, encode_header


def test_control_characters_and_separators_never_appear_raw():
    event = TraceEvent(mode="prod", action="fallback_base_model", adapter_name="x\r\nset-cookie: a=b,c",
                       timestamp=1.0)
    value = encode_header(event)
    assert "\r" not in value and "\n" not in value and value.count(",") == 3
    assert decode_header(value).adapter_name == "x\r\nset-cookie: a=b,c"

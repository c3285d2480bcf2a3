"""parse_json_line: one JSON object per streamed line, anything else a clear protocol error."""

from __future__ import annotations

import pytest

from iop_trio.adapters.base import BackendError
from iop_trio.adapters.http import parse_json_line


def test_an_object_is_returned() -> None:
    assert parse_json_line('{"choices":[{"delta":{"content":"hi"}}]}', "SSE chunk") == {
        "choices": [{"delta": {"content": "hi"}}]
    }


@pytest.mark.parametrize(
    "line",
    [
        '{"a": 1} trailing',  # extra data after the value
        '{"a": 1}{"b": 2}',  # two objects on one line
        '{"a": 1',  # cut off
        "",
        "[1, 2]",  # valid JSON, not an object
        '"text"',
        "[" * 100_000,  # nested deeper than the decoder can recurse
    ],
)
def test_anything_but_one_object_is_a_protocol_error(line: str) -> None:
    with pytest.raises(BackendError) as caught:
        parse_json_line(line, "SSE chunk")
    assert caught.value.code == "backend_protocol_error"
    assert "malformed SSE chunk" in str(caught.value)

"""The JSON a backend sends: streamed lines (parse_json_line), error bodies (error_detail) and
small documents (get_json). Anything malformed is a clear protocol error, never an exception
out of the adapter, however deeply it nests."""

from __future__ import annotations

import pytest
import trio

from iop_trio.adapters.base import BackendError
from iop_trio.adapters.http import error_detail, get_json, parse_json_line
from tests.adapters.test_backend_client import Backend, start

DEEP = "[" * 100_000  # nested deeper than the decoder can recurse


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
        DEEP,
    ],
)
def test_anything_but_one_object_is_a_protocol_error(line: str) -> None:
    with pytest.raises(BackendError) as caught:
        parse_json_line(line, "SSE chunk")
    assert caught.value.code == "backend_protocol_error"
    assert "malformed SSE chunk" in str(caught.value)


def test_an_error_body_gives_its_message_or_its_text() -> None:
    assert error_detail(b'{"error": {"message": "model is loading"}}') == "model is loading"
    assert error_detail(b'{"error": "no such model"}') == "no such model"
    assert error_detail(b"Bad Gateway") == "Bad Gateway"
    assert error_detail(DEEP.encode()) == DEEP[:4096]
    assert error_detail(b"") == "(empty body)"


async def test_a_document_that_is_not_json_is_a_protocol_error(nursery) -> None:
    backend = Backend()
    client = await start(nursery, backend)
    for body in (b"<html>", DEEP.encode()):
        backend.chunks = [body]
        with trio.fail_after(5), pytest.raises(BackendError) as caught:
            await get_json(client, "/models", read_timeout=5)
        assert caught.value.code == "backend_protocol_error"
    backend.chunks = [b'{"data": []}']
    assert await get_json(client, "/models", read_timeout=5) == {"data": []}
    await client.aclose()

"""The sans-IO HTTP/1.1 response reader: framing, keep-alive, and every malformed response a
:class:`ProtocolError`. Bytes are fed in arbitrary pieces: the result must not depend on them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_trio.adapters.http11 import ProtocolError, ResponseReader, encode_request

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"6\r\ndata: \r\n"
    b"1a;ext=1\r\n{\"choices\":[{\"text\":\"x\"}]}\r\n"
    b"0\r\nX-Trailer: yes\r\n\r\n"
)
CHUNKED_BODY = b'data: {"choices":[{"text":"x"}]}'


def read_all(response: bytes, cuts: list[int] = ()) -> tuple[ResponseReader, bytes]:
    """Feed ``response`` split at ``cuts``, then EOF; return the reader and the body read."""
    reader = ResponseReader()
    body = b""
    bounds = zip([0, *sorted(cuts)], [*sorted(cuts), len(response)], strict=True)
    pieces = [response[a:b] for a, b in bounds if b > a]
    for piece in [*pieces, b""]:  # b"": the connection ends
        if reader.complete:
            break
        reader.feed(piece)
        if reader.read_head():
            body += reader.read_body()
    return reader, body


@given(st.lists(st.integers(min_value=0, max_value=len(CHUNKED)), max_size=12))
def test_a_chunked_body_reads_the_same_however_it_is_split(cuts) -> None:
    reader, body = read_all(CHUNKED, cuts)
    assert (reader.status, reader.complete, reader.keep_alive, body) == (200, True, True, CHUNKED_BODY)


def test_chunks_that_arrived_together_come_out_together() -> None:
    reader = ResponseReader()
    reader.feed(CHUNKED)
    assert reader.read_head()
    assert reader.read_body() == CHUNKED_BODY
    assert reader.complete


def test_content_length_body_and_what_follows_it_is_left_alone() -> None:
    reader, body = read_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhello")
    assert (reader.status, body, reader.complete, reader.keep_alive) == (404, b"hello", True, True)


def test_connection_close_and_http_1_0_are_not_reused() -> None:
    closing, _ = read_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    old, _ = read_all(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert not closing.keep_alive and not old.keep_alive


def test_a_body_without_length_ends_with_the_connection() -> None:
    reader, body = read_all(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", [20])
    assert (body, reader.complete, reader.keep_alive) == (b"until the end", True, False)


def test_informational_responses_are_skipped() -> None:
    reader, body = read_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert (reader.status, body) == (200, b"ok")


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_statuses(status) -> None:
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 %d X\r\n\r\n" % status)
    assert reader.read_head() and reader.complete and reader.read_body() == b""


@pytest.mark.parametrize(
    "response",
    [
        b"SMTP/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 101 Switching\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nName : spaced\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nA: b\r\n folded\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x1\r\na\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000,
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # then the connection ends
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",  # ditto
        b"HTTP/1.1 200 OK\r\nContent-Le",  # the head never completes
        b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20_000,  # a head without end
    ],
)
def test_malformed_responses_are_protocol_errors(response) -> None:
    with pytest.raises(ProtocolError):
        read_all(response)


def test_request_bytes() -> None:
    data = encode_request("POST", b"/v1/chat", [(b"Host", b"h:1")], b"{}")
    assert data == b"POST /v1/chat HTTP/1.1\r\nHost: h:1\r\nContent-Length: 2\r\n\r\n{}"
    assert encode_request("GET", b"/v1/models", [], None) == b"GET /v1/models HTTP/1.1\r\n\r\n"

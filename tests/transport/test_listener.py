"""listener.py and dialer.py over real loopback sockets with real TLS (trustme files).

Real clock here (no ``autojump_clock``: MockClock may jump while a real socket is in flight), so
timeouts are small and every test is bounded by an absolute ``fail_after``. Each test runs the
listener in a nursery it cancels on the way out.
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from iop_trio.transport import (
    Backoff,
    ConnectionClosed,
    FramedConnection,
    HandshakeFailed,
    TlsConfig,
    TransportError,
    client_context,
    dial,
    serve_iop,
    server_context,
)
from iop_trio.transport.listener import format_address
from iop_trio.wire import Heartbeat, Message, RunEvent

HANDSHAKE_TIMEOUT = 0.5
TIMEOUT = 10


class EchoHandler:
    """Per connection: read one frame, answer with a RunEvent naming the peer, record the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[trio.abc.Stream, str, Message]] = []

    async def __call__(self, stream: trio.abc.Stream, peer: str) -> None:
        conn = FramedConnection(stream, peer=peer)
        message = await conn.receive()
        self.calls.append((stream, peer, message))
        await conn.send_now(RunEvent(run_id="echo", kind="complete", text=peer))


@asynccontextmanager
async def listening(
    handler: object, ssl_context: ssl.SSLContext | None
) -> AsyncIterator[tuple[str, int]]:
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            partial(
                serve_iop,
                "127.0.0.1",
                0,
                handler,  # type: ignore[arg-type]
                ssl_context=ssl_context,
                handshake_timeout=HANDSHAKE_TIMEOUT,
            )
        )
        host, _, port = bound.rpartition(":")
        yield host, int(port)
        nursery.cancel_scope.cancel()


async def talk(port: int, ssl_context: ssl.SSLContext | None, seq: int = 1) -> Message:
    """Dial, send one heartbeat, return the answer."""
    stream = await dial(
        "127.0.0.1", port, ssl_context=ssl_context, server_hostname="localhost"
    )
    async with stream:
        conn = FramedConnection(stream)
        await conn.send_now(Heartbeat(seq=seq))
        return await conn.receive()


# --- serve_iop -----------------------------------------------------------------------------------


async def test_reports_bound_address(server_tls: TlsConfig) -> None:
    with trio.fail_after(TIMEOUT):
        async with listening(EchoHandler(), server_context(server_tls)) as (host, port):
            assert host == "127.0.0.1"
            assert 0 < port < 65536
            # Listening by the time start() returned: a plain TCP connect succeeds at once.
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.aclose()


async def test_good_client_reaches_handler(server_tls: TlsConfig, client_tls: TlsConfig) -> None:
    handler = EchoHandler()
    with trio.fail_after(TIMEOUT):
        async with listening(handler, server_context(server_tls)) as (_, port):
            stream = await dial(
                "127.0.0.1", port, ssl_context=client_context(client_tls),
                server_hostname="localhost",
            )
            assert isinstance(stream, trio.SSLStream)
            local = stream.transport_stream.socket.getsockname()
            async with stream:
                conn = FramedConnection(stream)
                await conn.send_now(Heartbeat(seq=42))
                reply = await conn.receive()
                # The listener closes the stream once the handler returns.
                with pytest.raises(ConnectionClosed):
                    await conn.receive()

    assert len(handler.calls) == 1
    server_stream, peer, message = handler.calls[0]
    assert message == Heartbeat(seq=42)
    assert peer == f"127.0.0.1:{local[1]}"
    assert reply == RunEvent(run_id="echo", kind="complete", text=peer)
    # The handler got a TLS stream whose peer is the node's verified certificate.
    assert isinstance(server_stream, trio.SSLStream)
    cert = server_stream.getpeercert()
    assert cert is not None
    assert ("DNS", "node-1.iop.test") in cert["subjectAltName"]


async def test_stalled_plain_tcp_client_is_dropped_and_does_not_block_others(
    server_tls: TlsConfig, client_tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    handler = EchoHandler()
    caplog.set_level(logging.WARNING, logger="iop_trio.transport")
    with trio.fail_after(TIMEOUT):
        async with listening(handler, server_context(server_tls)) as (_, port):
            stalled = await trio.open_tcp_stream("127.0.0.1", port)  # never sends a ClientHello
            start = trio.current_time()
            # While that handshake is pending, another client is served normally.
            assert isinstance(await talk(port, client_context(client_tls), seq=1), RunEvent)
            try:
                leftover = await stalled.receive_some()
            except trio.BrokenResourceError:
                leftover = b""
            dropped_after = trio.current_time() - start
            await stalled.aclose()
            # And the listener keeps serving afterwards.
            assert isinstance(await talk(port, client_context(client_tls), seq=2), RunEvent)

    assert leftover == b""  # the server said nothing and hung up
    assert HANDSHAKE_TIMEOUT * 0.9 <= dropped_after < HANDSHAKE_TIMEOUT + 3
    assert [message for _, _, message in handler.calls] == [Heartbeat(seq=1), Heartbeat(seq=2)]
    refused = [r for r in caplog.records if r.getMessage() == "connection refused"]
    assert len(refused) == 1
    assert "0.5s" in refused[0].reason  # type: ignore[attr-defined]


async def test_garbage_instead_of_tls_is_dropped_at_once(server_tls: TlsConfig) -> None:
    handler = EchoHandler()
    with trio.fail_after(TIMEOUT):
        async with listening(handler, server_context(server_tls)) as (_, port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            start = trio.current_time()
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            try:
                leftover = await stream.receive_some()
            except trio.BrokenResourceError:
                leftover = b""
            elapsed = trio.current_time() - start
            await stream.aclose()
    assert leftover == b""
    assert elapsed < HANDSHAKE_TIMEOUT  # refused on the spot, not by the deadline
    assert handler.calls == []


@pytest.mark.parametrize("client", ["no-certificate", "other-ca"])
async def test_client_without_a_valid_certificate_never_reaches_handler(
    server_tls: TlsConfig,
    client_tls: TlsConfig,
    rogue_client_tls: TlsConfig,
    certless_client_context: ssl.SSLContext,
    client: str,
) -> None:
    handler = EchoHandler()
    context = (
        certless_client_context if client == "no-certificate" else client_context(rogue_client_tls)
    )
    with trio.fail_after(TIMEOUT):
        async with listening(handler, server_context(server_tls)) as (_, port):
            # With TLS 1.3 the client's handshake may complete before the server has checked
            # its certificate; the refusal then shows on the first receive.
            with pytest.raises(TransportError):
                await talk(port, context)
            # The listener is unharmed.
            assert isinstance(await talk(port, client_context(client_tls)), RunEvent)
    assert [message for _, _, message in handler.calls] == [Heartbeat(seq=1)]
    assert len(handler.calls) == 1


async def test_failing_handler_does_not_take_the_listener_down(
    server_tls: TlsConfig, client_tls: TlsConfig, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0
    echo = EchoHandler()

    async def handler(stream: trio.abc.Stream, peer: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("handler bug")
        await echo(stream, peer)

    with trio.fail_after(TIMEOUT):
        async with listening(handler, server_context(server_tls)) as (_, port):
            with pytest.raises(ConnectionClosed):
                await talk(port, client_context(client_tls))
            assert isinstance(await talk(port, client_context(client_tls)), RunEvent)
    assert calls == 2
    failures = [r for r in caplog.records if r.getMessage() == "connection handler failed"]
    assert len(failures) == 1
    assert failures[0].exc_info is not None


async def test_plain_tcp_when_tls_is_off() -> None:
    handler = EchoHandler()
    with trio.fail_after(TIMEOUT):
        async with listening(handler, None) as (_, port):
            reply = await talk(port, None)
    assert isinstance(reply, RunEvent)
    assert isinstance(handler.calls[0][0], trio.SocketStream)


def test_format_address_brackets_ipv6() -> None:
    assert format_address(("127.0.0.1", 4433)) == "127.0.0.1:4433"
    assert format_address(("::1", 4433, 0, 0)) == "[::1]:4433"


# --- dial ----------------------------------------------------------------------------------------


async def test_dial_refuses_a_server_from_another_ca(
    rogue_server_tls: TlsConfig, client_tls: TlsConfig
) -> None:
    handler = EchoHandler()
    with trio.fail_after(TIMEOUT):
        async with listening(handler, server_context(rogue_server_tls)) as (_, port):
            with pytest.raises(HandshakeFailed) as info:
                await dial(
                    "127.0.0.1", port, ssl_context=client_context(client_tls),
                    server_hostname="localhost",
                )
    assert isinstance(info.value.__cause__, trio.BrokenResourceError)
    assert isinstance(info.value.__cause__.__cause__, ssl.SSLCertVerificationError)
    assert handler.calls == []


async def test_dial_checks_the_host_name(server_tls: TlsConfig, client_tls: TlsConfig) -> None:
    with trio.fail_after(TIMEOUT):
        async with listening(EchoHandler(), server_context(server_tls)) as (_, port):
            # The default server_hostname is the host dialed: 127.0.0.1 is in the certificate.
            stream = await dial("127.0.0.1", port, ssl_context=client_context(client_tls))
            await stream.aclose()
            with pytest.raises(HandshakeFailed):
                await dial(
                    "127.0.0.1", port, ssl_context=client_context(client_tls),
                    server_hostname="other.example",
                )


async def test_dial_connection_refused_is_handshake_failed() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Nothing listens there any more.
    with trio.fail_after(TIMEOUT), pytest.raises(HandshakeFailed, match="cannot connect"):
        await dial("127.0.0.1", port, ssl_context=None)


async def test_dial_gives_up_on_a_server_that_never_answers_the_handshake(
    client_tls: TlsConfig,
) -> None:
    async def silent(stream: trio.abc.Stream, peer: str) -> None:
        await trio.sleep_forever()

    with trio.fail_after(TIMEOUT):
        async with listening(silent, None) as (_, port):
            start = trio.current_time()
            # dial's documented contract: trio.TooSlowError past handshake_timeout.
            with pytest.raises(trio.TooSlowError):
                await dial(
                    "127.0.0.1", port, ssl_context=client_context(client_tls),
                    handshake_timeout=0.3,
                )
            assert 0.25 <= trio.current_time() - start < 3


# --- Backoff -------------------------------------------------------------------------------------


def test_backoff_grows_exponentially_with_equal_jitter() -> None:
    backoff = Backoff(initial=0.5, maximum=30.0, rng=random.Random(1234))
    ceilings = [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]
    delays = [backoff.next_delay() for _ in ceilings]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert max(delays) <= 30.0


def test_backoff_is_capped_at_maximum() -> None:
    backoff = Backoff(initial=1.0, maximum=10.0, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(200)]
    assert all(d <= 10.0 for d in delays)
    assert all(5.0 <= d for d in delays[4:])  # from the 5th attempt on, the ceiling is 10


def test_backoff_reset_starts_over() -> None:
    backoff = Backoff(initial=0.5, maximum=30.0, rng=random.Random(99))
    for _ in range(8):
        backoff.next_delay()
    assert backoff.next_delay() >= 15.0
    backoff.reset()
    assert 0.25 <= backoff.next_delay() <= 0.5
    assert 0.5 <= backoff.next_delay() <= 1.0


def test_backoff_is_deterministic_for_a_seed_and_jitters() -> None:
    first = Backoff(rng=random.Random(5))
    second = Backoff(rng=random.Random(5))
    a = [first.next_delay() for _ in range(12)]
    b = [second.next_delay() for _ in range(12)]
    assert a == b
    # Jitter: with another seed the sequence differs (same ceilings, different draws).
    other = Backoff(rng=random.Random(6))
    assert [other.next_delay() for _ in range(12)] != a


def test_backoff_defaults() -> None:
    backoff = Backoff(rng=random.Random(0))
    assert backoff.initial == 0.5
    assert backoff.maximum == 30.0
    assert 0.25 <= backoff.next_delay() <= 0.5

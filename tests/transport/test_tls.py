"""tls.py: contexts built from the ``tls:`` files, exercised over in-memory TLS connections.

Every handshake here runs over ``memory_stream_pair`` wrapped in ``trio.SSLStream``: real TLS,
no sockets. With TLS 1.3 a client whose certificate the server rejects finishes its own
handshake before the server has looked at the certificate, so the refusal shows on the server's
handshake and, on the client, only as a broken stream on its first receive.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from iop_trio.transport import (
    FramedConnection,
    TlsConfig,
    TlsConfigError,
    client_context,
    server_context,
)
from iop_trio.wire import Heartbeat, ProtocolConnection, RunEvent, RunRequest

TIMEOUT = 5


def tls_pair(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str = "localhost"
) -> tuple[trio.SSLStream[Any], trio.SSLStream[Any]]:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    server = trio.SSLStream(server_raw, server_ctx, server_side=True)
    client = trio.SSLStream(client_raw, client_ctx, server_hostname=server_hostname)
    return server, client


async def capture(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``fn``; return its result or the exception it raised (so both sides can be checked)."""
    try:
        return await fn()
    except Exception as exc:
        return exc


async def both(
    server_fn: Callable[[], Awaitable[Any]], client_fn: Callable[[], Awaitable[Any]]
) -> tuple[Any, Any]:
    results: dict[str, Any] = {}

    async def run(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        results[name] = await capture(fn)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "server", server_fn)
        nursery.start_soon(run, "client", client_fn)
    return results["server"], results["client"]


def assert_broken(result: object) -> None:
    assert isinstance(result, trio.BrokenResourceError), f"expected a broken stream, got {result!r}"


# --- the happy path ------------------------------------------------------------------------------


async def test_mutual_tls_handshake_and_frames_both_ways(
    server_tls: TlsConfig, client_tls: TlsConfig
) -> None:
    server, client = tls_pair(server_context(server_tls), client_context(client_tls))
    request = RunRequest(run_id="r-1", model="tiny", prompt="hello", kind="completion")
    event = RunEvent(run_id="r-1", kind="complete", text="world")

    async def server_side() -> object:
        await server.do_handshake()
        conn = FramedConnection(server, peer="node")
        received = await conn.receive()
        await conn.send_now(event)
        return received

    async def client_side() -> object:
        await client.do_handshake()
        conn = FramedConnection(client, peer="edge")
        await conn.send_now(request)
        return await conn.receive()

    with trio.fail_after(TIMEOUT):
        server_got, client_got = await both(server_side, client_side)

    assert server_got == request
    assert client_got == event
    # Each side verified the other: the server holds the node's certificate, the client the edge's.
    client_cert = server.getpeercert()
    assert client_cert is not None
    assert ("DNS", "node-1.iop.test") in client_cert["subjectAltName"]
    server_cert = client.getpeercert()
    assert server_cert is not None
    assert ("DNS", "localhost") in server_cert["subjectAltName"]


async def test_frames_cross_with_writer_task_over_tls(
    server_tls: TlsConfig, client_tls: TlsConfig
) -> None:
    server, client = tls_pair(server_context(server_tls), client_context(client_tls))
    server_conn = FramedConnection(server)
    client_conn = FramedConnection(client)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.do_handshake)
            await client.do_handshake()
        async with trio.open_nursery() as nursery:
            server_conn.start_writer(nursery)
            client_conn.start_writer(nursery)
            for seq in range(50):
                await client_conn.send(Heartbeat(seq=seq))
                await server_conn.send(Heartbeat(seq=1000 + seq))
            assert [await server_conn.receive() for _ in range(50)] == [
                Heartbeat(seq=seq) for seq in range(50)
            ]
            assert [await client_conn.receive() for _ in range(50)] == [
                Heartbeat(seq=1000 + seq) for seq in range(50)
            ]
            nursery.cancel_scope.cancel()


def test_contexts_require_certificates_and_modern_tls(
    server_tls: TlsConfig, client_tls: TlsConfig
) -> None:
    server_ctx = server_context(server_tls)
    assert server_ctx.verify_mode == ssl.CERT_REQUIRED
    assert server_ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    client_ctx = client_context(client_tls)
    assert client_ctx.verify_mode == ssl.CERT_REQUIRED
    assert client_ctx.check_hostname is True
    assert client_ctx.minimum_version >= ssl.TLSVersion.TLSv1_2


# --- refusals ------------------------------------------------------------------------------------


async def _refused_client(
    server: trio.SSLStream[Any], client: trio.SSLStream[Any]
) -> tuple[Any, Any, list[bytes | bytearray]]:
    """Drive a handshake the server must refuse. The server does what the listener does on
    failure (close forcefully); the client, if its handshake completes, sends application data
    and waits for an answer. Returns both outcomes and whatever the server could read."""
    delivered: list[bytes | bytearray] = []

    async def server_side() -> object:
        try:
            await server.do_handshake()
        finally:
            try:
                delivered.append(await server.receive_some())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await trio.aclose_forcefully(server)
        return "accepted"

    async def client_side() -> object:
        await client.do_handshake()
        await client.send_all(ProtocolConnection().send(Heartbeat(seq=1)))
        return await client.receive_some()

    with trio.fail_after(TIMEOUT):
        server_result, client_result = await both(server_side, client_side)
    await trio.aclose_forcefully(client)
    return server_result, client_result, delivered


async def test_client_without_certificate_is_refused(
    server_tls: TlsConfig, certless_client_context: ssl.SSLContext
) -> None:
    server, client = tls_pair(server_context(server_tls), certless_client_context)
    server_result, client_result, delivered = await _refused_client(server, client)

    assert_broken(server_result)
    assert isinstance(server_result.__cause__, ssl.SSLError)
    # The client never gets an application byte back: its handshake fails, or (TLS 1.3) its
    # first receive finds the stream broken.
    assert_broken(client_result)
    assert delivered == []


async def test_client_certificate_from_another_ca_is_refused(
    server_tls: TlsConfig, rogue_client_tls: TlsConfig
) -> None:
    server, client = tls_pair(server_context(server_tls), client_context(rogue_client_tls))
    server_result, client_result, delivered = await _refused_client(server, client)

    assert_broken(server_result)
    assert isinstance(server_result.__cause__, ssl.SSLCertVerificationError)
    assert_broken(client_result)
    assert delivered == []


@pytest.mark.parametrize("hostname", ["localhost", "evil.example"])
async def test_client_refuses_untrusted_or_misnamed_server(
    server_tls: TlsConfig,
    rogue_server_tls: TlsConfig,
    client_tls: TlsConfig,
    hostname: str,
) -> None:
    # "localhost": the right name, but a certificate from another CA.
    # "evil.example": the right CA, but not the name the client asked for.
    impostor = rogue_server_tls if hostname == "localhost" else server_tls
    server, client = tls_pair(server_context(impostor), client_context(client_tls), hostname)

    async def server_side() -> object:
        try:
            await server.do_handshake()
            return await server.receive_some()
        finally:
            await trio.aclose_forcefully(server)

    async def client_side() -> object:
        try:
            await client.do_handshake()
        finally:
            await trio.aclose_forcefully(client)
        return "accepted"

    with trio.fail_after(TIMEOUT):
        server_result, client_result = await both(server_side, client_side)

    assert_broken(client_result)
    assert isinstance(client_result.__cause__, ssl.SSLCertVerificationError)
    assert_broken(server_result)


# --- configuration errors ------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["cert", "key", "ca"])
@pytest.mark.parametrize("make", [server_context, client_context])
def test_missing_file_is_a_config_error_naming_the_key(
    tmp_path: Path,
    client_tls: TlsConfig,
    field: str,
    make: Callable[[TlsConfig], ssl.SSLContext],
) -> None:
    missing = tmp_path / "nowhere" / f"{field}.pem"
    changes: dict[str, Any] = {field: str(missing)}
    tls = attrs.evolve(client_tls, **changes)
    with pytest.raises(TlsConfigError, match=rf"tls\.{field}\b") as info:
        make(tls)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_directory_instead_of_file_is_a_config_error(tmp_path: Path, client_tls: TlsConfig) -> None:
    with pytest.raises(TlsConfigError, match=r"tls\.ca"):
        client_context(attrs.evolve(client_tls, ca=str(tmp_path)))


def test_unreadable_material_is_a_config_error(tmp_path: Path, client_tls: TlsConfig) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n")
    for field in ("cert", "key", "ca"):
        changes: dict[str, Any] = {field: str(garbage)}
        tls = attrs.evolve(client_tls, **changes)
        with pytest.raises(TlsConfigError, match="cannot load TLS material") as info:
            server_context(tls)
        assert isinstance(info.value.__cause__, ssl.SSLError | OSError)


def test_key_not_matching_certificate_is_a_config_error(
    client_tls: TlsConfig, server_tls: TlsConfig
) -> None:
    with pytest.raises(TlsConfigError, match="cannot load TLS material"):
        client_context(attrs.evolve(client_tls, key=server_tls.key))

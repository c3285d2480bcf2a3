"""The IOP listener: TCP (+ TLS) accept loop, one task per connection.

``SSLListener.accept`` does not handshake, so the handshake runs in the connection's own task
under a deadline: a client that never finishes it (or brings no certificate) costs one task for at
most ``handshake_timeout`` seconds and never blocks other connections.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from .errors import HandshakeFailed

log = logging.getLogger("iop_trio.transport")

ConnectionHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]


def format_address(sockaddr: tuple[object, ...]) -> str:
    host, port = str(sockaddr[0]), sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def handshake(stream: trio.SSLStream[trio.SocketStream]) -> None:
    """Complete the TLS handshake; a refused certificate or a dropped peer is HandshakeFailed.
    Callers bound it with their own deadline."""
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        raise HandshakeFailed(f"TLS handshake failed: {exc.__cause__ or exc}") from exc


async def _accept_one(
    handler: ConnectionHandler,
    ssl_context: ssl.SSLContext | None,
    handshake_timeout: float,
    tcp_stream: trio.SocketStream,
) -> None:
    try:
        peer = format_address(tcp_stream.socket.getpeername())
    except OSError:
        await tcp_stream.aclose()
        return  # the client already left
    stream: trio.abc.Stream = tcp_stream
    if ssl_context is not None:
        ssl_stream = trio.SSLStream(tcp_stream, ssl_context, server_side=True)
        try:
            with trio.fail_after(handshake_timeout):
                await handshake(ssl_stream)
        except (HandshakeFailed, trio.TooSlowError) as exc:
            reason = str(exc) or f"no TLS handshake within {handshake_timeout:g}s"
            log.warning("connection refused", extra={"peer": peer, "reason": reason})
            await trio.aclose_forcefully(ssl_stream)
            return
        stream = ssl_stream
    try:
        await handler(stream, peer)
    except* Exception as group:
        # One connection's failure must never take the listener down; the bug is logged whole.
        log.error("connection handler failed", extra={"peer": peer}, exc_info=group)
    finally:
        await trio.aclose_forcefully(stream)


async def serve_iop(
    host: str,
    port: int,
    handler: ConnectionHandler,
    *,
    ssl_context: ssl.SSLContext | None,
    handshake_timeout: float = 10.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host:port`` (port 0 picks one) and report the bound address once listening.

    ``handler`` must not raise for ordinary connection failures: one connection's trouble must
    never take the listener down.
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    bound = format_address(listeners[0].socket.getsockname())
    task_status.started(bound)
    await trio.serve_listeners(
        partial(_accept_one, handler, ssl_context, handshake_timeout), listeners
    )

"""Serve one framed connection: writer, heartbeats and a read loop in one nursery.

The nursery is the connection's lifetime. Whatever the handler starts in it (the node's runs)
is cancelled when the connection ends, for whatever reason: EOF, broken stream, protocol error or
a silent peer.
"""

from __future__ import annotations

from typing import Protocol

import trio

from ..wire import Error, Message, RemoteProtocolError
from .errors import ConnectionClosed
from .framed import FramedConnection
from .heartbeat import keep_alive


class PeerHandler(Protocol):
    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        """Handle one message; long work goes into ``nursery`` so the read loop keeps reading."""


async def serve_peer(
    conn: FramedConnection, handler: PeerHandler, *, heartbeat_interval: float
) -> None:
    """Run until the connection ends; the reason propagates (in an ExceptionGroup)."""
    async with trio.open_nursery() as nursery:
        conn.start_writer(nursery)
        nursery.start_soon(keep_alive, conn, heartbeat_interval)
        try:
            while True:
                message = await conn.receive()
                await handler.on_message(message, nursery)
        except RemoteProtocolError as exc:
            await reject_peer(conn, exc.code, str(exc))
            raise


async def reject_peer(conn: FramedConnection, code: str, reason: str) -> None:
    """Tell the peer why (best effort, bounded), then close the connection."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await conn.send_now(Error(code=code, message=reason))
        except ConnectionClosed:
            pass  # the peer is already gone; there is nobody left to tell
    await conn.flush_and_close()

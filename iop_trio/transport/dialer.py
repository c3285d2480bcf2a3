"""Dialing the edge: one connection attempt, and a jittered exponential backoff for retries."""

from __future__ import annotations

import random
import ssl

import attrs
import trio

from .errors import HandshakeFailed
from .listener import handshake


@attrs.define
class Backoff:
    """Exponential backoff with "equal jitter": each delay is uniform in [d/2, d], d doubling
    from ``initial`` to ``maximum``; :meth:`reset` after a connection that worked."""

    initial: float = 0.5
    maximum: float = 30.0
    rng: random.Random = attrs.field(factory=random.Random)
    _attempt: int = 0

    def next_delay(self) -> float:
        ceiling = min(self.maximum, self.initial * (2**self._attempt))
        self._attempt += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._attempt = 0


async def dial(
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None = None,
    handshake_timeout: float = 10.0,
) -> trio.abc.Stream:
    """Open a TCP connection and, when TLS is on, complete a verified handshake
    (``trio.TooSlowError`` past ``handshake_timeout``, a config value of the node)."""
    try:
        tcp_stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise HandshakeFailed(f"cannot connect to {host}:{port}: {exc}") from exc
    if ssl_context is None:
        return tcp_stream
    ssl_stream = trio.SSLStream(
        tcp_stream, ssl_context, server_hostname=server_hostname or host
    )
    try:
        with trio.fail_after(handshake_timeout):
            await handshake(ssl_stream)
    except BaseException:
        await trio.aclose_forcefully(ssl_stream)
        raise
    return ssl_stream

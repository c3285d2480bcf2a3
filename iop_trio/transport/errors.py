"""Transport errors: what can end a framed connection besides a protocol error."""

from __future__ import annotations


class TransportError(Exception):
    """Base of the transport layer's errors."""


class ConnectionClosed(TransportError):
    """The peer closed the connection or the stream broke."""


class HeartbeatTimeout(TransportError):
    """The peer sent nothing for three heartbeat intervals."""


class HandshakeFailed(TransportError):
    """TLS handshake or registration did not complete (bad certificate, timeout, refusal)."""


def broken_reason(exc: BaseException) -> str:
    """Why a stream broke: trio's Broken/Closed errors often carry it only in ``__cause__``."""
    return str(exc) or str(exc.__cause__ or "") or type(exc).__name__

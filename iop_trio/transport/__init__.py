"""Trio transport for IOP: TLS contexts, framed connections, heartbeats, listener and dialer."""

from .dialer import Backoff, dial
from .errors import ConnectionClosed, HandshakeFailed, HeartbeatTimeout, TransportError
from .framed import FramedConnection
from .heartbeat import keep_alive
from .listener import serve_iop
from .peer import PeerHandler, reject_peer, serve_peer
from .tls import TlsConfig, TlsConfigError, client_context, server_context

__all__ = [
    "Backoff",
    "ConnectionClosed",
    "FramedConnection",
    "HandshakeFailed",
    "HeartbeatTimeout",
    "PeerHandler",
    "TlsConfig",
    "TlsConfigError",
    "TransportError",
    "client_context",
    "dial",
    "keep_alive",
    "reject_peer",
    "serve_iop",
    "serve_peer",
    "server_context",
]

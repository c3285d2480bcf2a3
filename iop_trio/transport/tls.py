"""SSL contexts from the ``tls:`` block shared by every role's config.

With TLS enabled both sides present certificates issued by the configured CA: the listener
requires and verifies client certificates (``CERT_REQUIRED``), the dialer verifies the server.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from attrs import frozen


@frozen
class TlsConfig:
    """Each role's config provides its own defaults (the edge's or the node's files); a ``tls:``
    block given in YAML must name all three files, so no role silently uses another's."""

    enabled: bool = True
    cert: str = ""
    key: str = ""
    ca: str = ""


class TlsConfigError(ValueError):
    """A certificate, key or CA file is missing or unreadable."""


def _load(context: ssl.SSLContext, tls: TlsConfig) -> ssl.SSLContext:
    for label, path in (("cert", tls.cert), ("key", tls.key), ("ca", tls.ca)):
        if not path:
            raise TlsConfigError(f"tls.{label}: required when tls.enabled is true")
        if not Path(path).is_file():
            raise TlsConfigError(f"tls.{label}: file not found: {path}")
    try:
        context.load_cert_chain(tls.cert, tls.key)
        context.load_verify_locations(cafile=tls.ca)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"cannot load TLS material ({tls.cert}, {tls.key}, {tls.ca}): {exc}") from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """Context for the IOP listener: mutual TLS, client certificate required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load(context, tls)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """Context for a dialer: verifies the server's certificate and host name, presents its own."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _load(context, tls)
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    return context

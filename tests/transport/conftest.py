"""Shared fixtures for the transport tests: trustme CAs written to PEM files, as the config uses them.

Two independent CAs: ``ca`` is the deployment's CA, ``rogue_ca`` stands for anybody else. Every
TlsConfig points to real files under a temporary directory, because ``tls.py`` only takes paths.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
import trustme

from iop_trio.transport import TlsConfig

MakeTls = Callable[..., TlsConfig]


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def rogue_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pki")


def write_tls(
    directory: Path, name: str, issuer: trustme.CA, trusted: trustme.CA, *identities: str
) -> TlsConfig:
    """A cert/key issued by ``issuer`` for ``identities`` and a CA file holding ``trusted``."""
    leaf = issuer.issue_cert(*identities)
    cert = directory / f"{name}.crt"
    key = directory / f"{name}.key"
    ca_file = directory / f"{name}-ca.crt"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    trusted.cert_pem.write_to_path(str(ca_file))
    return TlsConfig(enabled=True, cert=str(cert), key=str(key), ca=str(ca_file))


@pytest.fixture(scope="session")
def server_tls(pki_dir: Path, ca: trustme.CA) -> TlsConfig:
    """The edge: a server certificate for localhost / 127.0.0.1 from the deployment CA."""
    return write_tls(pki_dir, "server", ca, ca, "localhost", "127.0.0.1")


@pytest.fixture(scope="session")
def client_tls(pki_dir: Path, ca: trustme.CA) -> TlsConfig:
    """A node: a client certificate from the deployment CA."""
    return write_tls(pki_dir, "client", ca, ca, "node-1.iop.test")


@pytest.fixture(scope="session")
def rogue_client_tls(pki_dir: Path, ca: trustme.CA, rogue_ca: trustme.CA) -> TlsConfig:
    """A client whose certificate comes from another CA (it still trusts the real server)."""
    return write_tls(pki_dir, "rogue-client", rogue_ca, ca, "node-1.iop.test")


@pytest.fixture(scope="session")
def rogue_server_tls(pki_dir: Path, ca: trustme.CA, rogue_ca: trustme.CA) -> TlsConfig:
    """A server impersonating the edge with a certificate from another CA."""
    return write_tls(pki_dir, "rogue-server", rogue_ca, ca, "localhost", "127.0.0.1")


@pytest.fixture
def certless_client_context(server_tls: TlsConfig) -> ssl.SSLContext:
    """A client that verifies the server against the right CA but has no certificate to show."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=server_tls.ca)
    return context

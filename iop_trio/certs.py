"""Development PKI: a CA, an edge (server) certificate and node (client) certificates.

``iop-trio certs init DIR`` and ``iop-trio up`` use it. Keys are P-256 and written 0600. For
production, use certificates from your own CA with the same roles (see docs/operations.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
VALIDITY = datetime.timedelta(days=825)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "IOP-Trio development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode only applies to a new file
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class DevCA:
    def __init__(self, common_name: str = "IOP-Trio development CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, common_name: str, *, server: bool, hosts: Iterable[str] = ()
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        hosts = list(hosts)
        if hosts:
            builder = builder.add_extension(_san(hosts), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key

    def write_pair(self, directory: Path, name: str, *, server: bool, hosts: Iterable[str] = ()) -> None:
        cert, key = self.issue(name, server=server, hosts=hosts)
        _write_cert(directory / f"{name}.crt", cert)
        _write_key(directory / f"{name}.key", key)


def init_certs(
    directory: str | Path, nodes: Iterable[str] = ("node",), hosts: Iterable[str] = DEFAULT_HOSTS
) -> list[Path]:
    """Write ca.crt/ca.key, edge.crt/edge.key and NAME.crt/NAME.key per node; return the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca = DevCA()
    _write_cert(directory / "ca.crt", ca.cert)
    _write_key(directory / "ca.key", ca.key)
    ca.write_pair(directory, "edge", server=True, hosts=hosts)
    for node in nodes:
        ca.write_pair(directory, node, server=False)
    return sorted(directory.iterdir())

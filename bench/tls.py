"""TLS in front of Temporal, as a secured cluster has it, for tests and the multi-host run: a
throwaway PKI (one CA, a server certificate for localhost, 127.0.0.1 and any other addresses,
a client certificate, as PEM files) and HAProxy from the OS packages as the terminator."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(directory: Path, server_ips: Sequence[str] = ()) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("ballast test CA")
    ca = _sign(
        x509.CertificateBuilder().subject_name(ca_name).public_key(ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False),
        ca_name, ca_key,
    )  # fmt: skip
    paths = Pki(*(directory / f for f in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))
    _write_cert(paths.ca_cert, ca)
    for cert_path, key_path, cn, usage, sans in (
        (paths.server_cert, paths.server_key, "localhost", ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.DNSName("localhost"),
          *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *server_ips))]),
        (paths.client_cert, paths.client_key, "ballast test client", ExtendedKeyUsageOID.CLIENT_AUTH,
         [x509.DNSName("client.ballast.test")]),
    ):  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _sign(
            x509.CertificateBuilder().subject_name(_name(cn)).public_key(key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False),
            ca_name, ca_key,
        )  # fmt: skip
        _write_cert(cert_path, cert)
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _sign(builder: x509.CertificateBuilder, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    return (builder.issuer_name(issuer).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))  # fmt: skip


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def haproxy() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise FileNotFoundError("haproxy is not installed: run `make test-deps` (`make test` does), "
                                "which installs it from apt")
    return found


def haproxy_conf(pki: Pki, directory: Path, *, accept: str, connect: str) -> Path:
    """HAProxy on `accept`: TLS with ALPN h2 outside (gRPC insists on it), the client's
    certificate verified against the CA, the bytes (HTTP/2 in plain text) passed to `connect`."""
    bundle = directory / "server-bundle.pem"  # HAProxy takes the certificate and its key in one file
    bundle.write_bytes(pki.server_cert.read_bytes() + pki.server_key.read_bytes())
    bundle.chmod(0o600)
    config = directory / "haproxy.cfg"
    config.write_text(f"""
global
    log stderr format raw local0 info
defaults
    mode tcp
    log global
    timeout connect 5s
    # Temporal's long polls are quiet for up to a minute.
    timeout client 10m
    timeout server 10m
frontend temporal_tls
    bind {accept} ssl crt {bundle} ca-file {pki.ca_cert} verify required alpn h2
    default_backend temporal
backend temporal
    server temporal {connect}
""")
    return config

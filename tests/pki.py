"""Certificates made in the test: a CA, a server certificate for localhost, client certificates
with any subject, as PEM bytes (for TLS and mutual-TLS tests)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Issued = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def issue(name: str, issuer: Issued | None, *, ca: bool = False, organization: str | None = None) -> Issued:
    """A certificate for subject CN=`name` (and O=`organization`), signed by `issuer` (self-signed
    when None); end-entity certificates name localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    if organization is not None:
        attributes.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    subject = x509.Name(attributes)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    signer = issuer[1] if issuer else key
    return builder.sign(signer, hashes.SHA256()), key


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_server_files(folder: Path, ca: Issued) -> dict[str, str]:
    """The server's certificate, key and the client CA as files; their paths by config key."""
    server = issue("localhost", ca)
    files = {
        "tls_cert_file": pem(server[0]),
        "tls_key_file": key_pem(server[1]),
        "tls_client_ca_file": pem(ca[0]),
    }
    paths = {}
    for key, data in files.items():
        (folder / f"{key}.pem").write_bytes(data)
        paths[key] = str(folder / f"{key}.pem")
    return paths


# The server certificate names localhost; clients connect to 127.0.0.1.
LOCALHOST = [("grpc.ssl_target_name_override", "localhost")]

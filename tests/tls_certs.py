"""A self-signed certificate (for 127.0.0.1 / localhost unless told otherwise), made at test time (never checked in)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(directory: Path, name: str = "gateway", dns: str = "localhost", ip: str | None = "127.0.0.1",
                starts: datetime.timedelta = datetime.timedelta(minutes=-5),
                ends: datetime.timedelta = datetime.timedelta(days=1)) -> tuple[Path, Path]:
    """Write `name`.crt and `name`.key (EC P-256, valid from now + `starts` to now + `ends`, naming `dns`
    and `ip`) under `directory`; return their paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + starts)
        .not_valid_after(now + ends)
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName(dns), *([x509.IPAddress(ipaddress.ip_address(ip))] if ip else []),
        ]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path

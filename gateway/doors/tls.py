"""TLS for the gateway's doors: the HTTP door, and the gRPC server that carries both the gRPC front door
and the control port (one listener). Certificates are PEM files named in the config and read once at
start-up; a file that cannot be read, or a certificate out of its validity dates (expired, or not valid
yet), stops the gateway with an error naming the setting: clients and engines would refuse the handshake.

    gateway:
      tls:
        http: {cert_file: /etc/heterogate/tls.crt, key_file: /etc/heterogate/tls.key}
        grpc: {cert_file: /etc/heterogate/tls.crt, key_file: /etc/heterogate/tls.key}
        ca_file: /etc/heterogate/ca.crt   # what engines the gateway launches trust; default: grpc.cert_file

Engines the gateway launches dial the control port at the address the gateway gives them (127.0.0.1
for a wildcard listen address), so the gRPC certificate must name that address.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
from cryptography import x509

from common.errors import ConfigError
from gateway.config.sections import TlsConfig


def read_pem(path: Path, setting: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{setting}: {path} is not a PEM file")
    return data


@dataclass(frozen=True)
class GrpcTls:
    """The gRPC server's key pair, and the CA the engines it launches trust."""

    cert: bytes
    key: bytes
    ca_file: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)])


def load_grpc_tls(config: TlsConfig) -> GrpcTls | None:
    if config.grpc is None:
        if config.ca_file is not None:
            raise ConfigError("gateway.tls.ca_file: applies only with gateway.tls.grpc")
        return None
    cert = read_pem(config.grpc.cert_file, "gateway.tls.grpc.cert_file")
    key = read_pem(config.grpc.key_file, "gateway.tls.grpc.key_file")
    # grpc reads them only when the port is added, and says no more than that it failed (start-up read it
    # as a port in use), so they are loaded here first, as the HTTP door's are
    server_context(config.grpc.cert_file, config.grpc.key_file, "gateway.tls.grpc")
    ca_file = config.ca_file or config.grpc.cert_file
    read_pem(ca_file, "gateway.tls.ca_file")
    try:   # a file of no certificate (a key given as the CA) left every launched engine unable to connect
        ssl.create_default_context(cafile=str(ca_file))
    except ssl.SSLError as exc:
        raise ConfigError(f"gateway.tls.ca_file: {ca_file} holds no CA certificate the engines could trust: "
                          f"{exc.reason or exc}") from None
    check_dates(ca_file, "gateway.tls.ca_file")
    return GrpcTls(cert, key, ca_file)


def check_dates(cert_file: Path, setting: str, now: datetime | None = None) -> None:
    """ConfigError naming `setting` where the first certificate in `cert_file` (the server's own, or the
    CA) is expired or not valid yet at `now` (default: this moment)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except ValueError as exc:   # a file the ssl module took that does not start with a certificate
        raise ConfigError(f"{setting}: {cert_file} does not start with a PEM certificate: {exc}") from None
    now = now or datetime.now(UTC)
    if now > cert.not_valid_after_utc:
        raise ConfigError(f"{setting}: the certificate in {cert_file} expired on "
                          f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: renew it")
    if now < cert.not_valid_before_utc:
        raise ConfigError(f"{setting}: the certificate in {cert_file} is not valid until "
                          f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this machine's clock right?)")


def server_context(cert_file: Path, key_file: Path, setting: str) -> ssl.SSLContext:
    """A server context of this certificate and key; ConfigError naming `setting` where they do not load
    (a broken certificate, a key of another certificate, the two swapped)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ConfigError(f"{setting}: the certificate and key do not load: {exc.reason or exc}") from None
    check_dates(cert_file, setting)
    return context


def http_ssl_context(config: TlsConfig) -> ssl.SSLContext | None:
    """The HTTP door's server context, loaded at start-up so a bad certificate or key stops it with a
    message naming the setting."""
    if config.http is None:
        return None
    read_pem(config.http.cert_file, "gateway.tls.http.cert_file")
    read_pem(config.http.key_file, "gateway.tls.http.key_file")
    return server_context(config.http.cert_file, config.http.key_file, "gateway.tls.http")

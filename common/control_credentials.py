"""What a heartbeat sender shows the gateway's control port: the cluster token, the engine identity a
gateway gave the engine it launched, and the CA to trust when the port speaks TLS.

On the wire: gRPC metadata `authorization: Bearer <cluster token>` and `x-heterogate-engine-identity:
<secret>` on the Connect stream; a TLS channel when a CA is given. Engines launched by the gateway get
all three through their environment (`ENV_*` below), so nothing secret appears in a process list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.errors import ConfigError

ENV_CLUSTER_TOKEN = "HETEROGATE_CLUSTER_TOKEN"
ENV_ENGINE_IDENTITY = "HETEROGATE_ENGINE_IDENTITY"
ENV_CONTROL_CA = "HETEROGATE_CONTROL_CA"
IDENTITY_METADATA = "x-heterogate-engine-identity"


def read_secret_file(path: Path, setting: str) -> str:
    """The first line of a secret file; a missing, unreadable or empty file is a ConfigError naming `setting`."""
    try:
        value = path.read_text().strip().splitlines()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if not value or not value[0].strip():
        raise ConfigError(f"{setting}: {path} is empty")
    return value[0].strip()


@dataclass(frozen=True)
class ControlCredentials:
    token: str | None = None
    identity: str | None = None
    ca_pem: bytes | None = None   # None: plaintext (a loopback control port)

    @classmethod
    def from_env(cls) -> ControlCredentials:
        ca_path = os.environ.get(ENV_CONTROL_CA)
        ca = None
        if ca_path:
            try:
                ca = Path(ca_path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"{ENV_CONTROL_CA}: cannot read {ca_path}: {exc.strerror}") from None
        return cls(os.environ.get(ENV_CLUSTER_TOKEN) or None, os.environ.get(ENV_ENGINE_IDENTITY) or None, ca)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        out: list[tuple[str, str]] = []
        if self.token:
            out.append(("authorization", f"Bearer {self.token}"))
        if self.identity:
            out.append((IDENTITY_METADATA, self.identity))
        return tuple(out)

    def channel(self, address: str) -> grpc.aio.Channel:
        if self.ca_pem is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=self.ca_pem))

"""Who may heartbeat to the control port, and what a heartbeat may change.

A heartbeat moves routing (load signals, and the address requests go to), so the control port trusts
no one by default:

- **Cluster token.** With `gateway.auth.cluster_token_file` / `cluster_token_env` set (or, when
  neither is, `$HETEROGATE_CLUSTER_TOKEN` in the gateway's environment), every Connect stream must
  carry `authorization: Bearer <token>` (else UNAUTHENTICATED). The token is required whenever API
  keys are on or the control port listens beyond loopback: the gateway refuses to start without one
  rather than run an open control port.
- **Engine identity.** Each engine the gateway launches gets a random secret of its own in its
  environment; a heartbeat for a managed backend id must carry it (else PERMISSION_DENIED), token or
  not. Nobody else can take over a managed id, move it, or register as it with another gateway.
  With replicas, every replica checks it against the digest the launching replica announces
  through Redis (engine_identities.py), so an engine may heartbeat to any of them.
- **Address moves.** A heartbeat that would move a backend to another address must prove it is that
  backend: the engine identity for a managed backend, the cluster token for any other. On an open
  loopback control port (no token) an external backend keeps the first address it was given.
- **Watched upstreams.** A `kind: openai` backend has no agent of its own unless its entry says
  `agent: true`: the gateway probes and scrapes it itself, so a heartbeat for it can only be a mistake
  or an impostor (one could advertise any context length), and is refused (PERMISSION_DENIED).

The check runs when a stream names a backend and whenever a message carries a new address; a refused
stream changes nothing in the state table.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.control_credentials import (
    ENV_CLUSTER_TOKEN,
    ENV_CONTROL_CA,
    ENV_ENGINE_IDENTITY,
    IDENTITY_METADATA,
    read_secret_file,
)
from common.errors import ConfigError
from gateway.config.auth import AuthConfig, env_setting
from gateway.control.engine_identities import EngineIdentities
from gateway.routing.backend_entry import BackendEntry


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False   # a host name or a wildcard (0.0.0.0, ::) listens beyond loopback


def load_cluster_token(config: AuthConfig) -> str | None:
    if config.cluster_token_file is not None and config.cluster_token_env is not None:
        raise ConfigError("gateway.auth: set cluster_token_file or cluster_token_env, not both")
    if config.cluster_token_file is not None:
        return read_secret_file(config.cluster_token_file, "gateway.auth.cluster_token_file")
    if config.cluster_token_env is not None:
        return env_setting(config.cluster_token_env, "cluster_token_env")
    return os.environ.get(ENV_CLUSTER_TOKEN, "").strip() or None   # the conventional variable, when set


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str


@dataclass
class ControlAuth:
    token: str | None = None
    identities: EngineIdentities = field(default_factory=EngineIdentities)   # managed backends' engines
    ca_file: Path | None = None                                 # TLS control port: what local clients trust
    agents: frozenset[str] = frozenset()   # the kind: openai backends that take heartbeats (`agent: true`)

    @classmethod
    def load(
        cls, config: AuthConfig, *, managed: Iterable[str], api_keys_on: bool, control_host: str,
        ca_file: Path | None = None, launching: bool = True, agents: Iterable[str] = (),
    ) -> ControlAuth:
        """ConfigError (naming the setting) for a missing token source, or a token the setup requires.
        `launching`: False for a replica that launches the engines only once it leads."""
        token = load_cluster_token(config)
        if token is None and (api_keys_on or not is_loopback(control_host)):
            why = "API keys are on" if api_keys_on else f"the control port listens on {control_host}, beyond loopback"
            raise ConfigError(f"gateway.auth.cluster_token_file or cluster_token_env is required, or the token in "
                              f"${ENV_CLUSTER_TOKEN}: {why}")
        return cls(token, EngineIdentities.drawn(managed, launching=launching), ca_file, frozenset(agents))

    # -- what the gateway hands out --------------------------------------------------------------

    def engine_env(self, backend_id: str) -> dict[str, str]:
        """Environment of the engine launched for `backend_id`: its identity, the token, the CA."""
        env = {ENV_ENGINE_IDENTITY: self.identities.secret(backend_id)}
        if self.token is not None:
            env[ENV_CLUSTER_TOKEN] = self.token
        if self.ca_file is not None:
            env[ENV_CONTROL_CA] = str(self.ca_file)
        return env

    # -- what the control port checks ------------------------------------------------------------

    def authenticate(self, metadata: dict[str, str]) -> Refusal | None:
        if self.token is None:
            return None
        scheme, _, given = metadata.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return Refusal(grpc.StatusCode.UNAUTHENTICATED,
                           "missing or invalid cluster token: send 'authorization: Bearer <token>' metadata")
        return None

    def admit(self, entry: BackendEntry, address: str, metadata: dict[str, str]) -> Refusal | None:
        """May this (authenticated) stream speak for `entry`, from `address`?"""
        if entry.external and entry.id not in self.agents:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                           f"backend {entry.id!r} is a kind: openai backend the gateway watches itself; it takes "
                           "heartbeats only with `agent: true` on its entry in the gateway's backends file")
        if entry.id in self.identities:
            if not self.identities.verify(entry.id, metadata.get(IDENTITY_METADATA, "")):
                return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                               f"backend {entry.id!r} is launched by the gateway; the heartbeat does not carry "
                               "the identity the gateway gave that engine")
            return None
        moving = bool(address) and entry.address is not None and address.rstrip("/") != entry.address.rstrip("/")
        if moving and self.token is None:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                           f"heartbeat would move backend {entry.id!r} from {entry.address} to {address}; "
                           "moving a backend needs the cluster token")
        return None

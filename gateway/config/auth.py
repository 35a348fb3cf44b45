"""Optional API keys: bearer tokens from a file or an environment variable.

With no keys configured the gateway is open (the default, as for a loopback demo). With keys, every
/v1 endpoint needs `Authorization: Bearer <key>`; /admin and /metrics need an admin key. Keys are
compared in constant time against every configured key, and are never logged.

A setting that names a file that cannot be read or holds no key, or an environment variable that is
not set or holds no key (only separators), is a ConfigError naming the setting: the gateway never
starts open because a secret went missing. The cluster token of the control port
(`gateway.control.control_auth`) is configured here too.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError
from common.yaml_files import StrictModel
from gateway.requests.errors import Unauthorized


class AuthConfig(StrictModel):
    api_keys_file: Path | None = None        # one key per line; blank lines and #comments ignored
    api_keys_env: str | None = None          # comma-separated keys
    admin_keys_file: Path | None = None
    admin_keys_env: str | None = None
    cluster_token_file: Path | None = None   # heartbeats to the control port: first line of the file
    cluster_token_env: str | None = None


def env_setting(name: str, setting: str) -> str:
    """The value of the environment variable a setting names; unset or empty is a ConfigError."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"gateway.auth.{setting}: environment variable {name} is not set")
    return value


def _read(file: Path | None, env: str | None, kind: str) -> tuple[bytes, ...]:
    keys: list[str] = []
    if file is not None:
        try:
            lines = file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"gateway.auth.{kind}_keys_file: cannot read {file}: {exc.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise ConfigError(f"gateway.auth.{kind}_keys_file: {file} holds no keys")
    if env is not None:
        from_env = [k.strip() for k in env_setting(env, f"{kind}_keys_env").split(",") if k.strip()]
        if not from_env:   # e.g. " , ": set, yet zero keys would leave the gateway open
            raise ConfigError(f"gateway.auth.{kind}_keys_env: environment variable {env} holds no keys "
                              "(only separators)")
        keys += from_env
    return tuple(k.encode() for k in keys)


@dataclass(frozen=True)
class KeyRing:
    user: tuple[bytes, ...]
    admin: tuple[bytes, ...]

    @classmethod
    def load(cls, config: AuthConfig) -> KeyRing:
        return cls(_read(config.api_keys_file, config.api_keys_env, "api"),
                   _read(config.admin_keys_file, config.admin_keys_env, "admin"))

    @property
    def enabled(self) -> bool:
        return bool(self.user or self.admin)

    def check(self, authorization: str | None, *, admin: bool) -> None:
        """Raise Unauthorized unless the header carries a valid key (an admin key when `admin`)."""
        if not self.enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        candidate = token.strip().encode()
        allowed = self.admin if admin else self.user + self.admin
        match = False
        for key in allowed:   # no early exit: the time taken does not depend on which key matched
            match |= hmac.compare_digest(candidate, key)
        if not match:
            raise Unauthorized("admin API key required" if admin else "invalid API key")

"""Optional API keys: bearer tokens from a file or an environment variable.

With no keys configured the gateway is open (the default, as for a loopback demo). With keys, every
/v1 endpoint needs `Authorization: Bearer <key>`; /admin and /metrics need an admin key. Keys are
compared in constant time against every configured key, and are never logged. A key of a tenant
(`gateway.tenants.teams`, gateway/config/tenants.py) is an API key too, and `check` says whose it is.

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
from gateway.config.tenants import TenantsConfig
from gateway.requests.errors import Forbidden, Unauthorized
from gateway.requests.job import DEFAULT_TENANT


class AuthConfig(StrictModel):
    api_keys_file: Path | None = None        # one key per line; blank lines and #comments ignored
    api_keys_env: str | None = None          # comma-separated keys
    admin_keys_file: Path | None = None
    admin_keys_env: str | None = None
    cluster_token_file: Path | None = None   # heartbeats to the control port: first line of the file
    cluster_token_env: str | None = None


def env_setting(name: str, setting: str, section: str = "gateway.auth") -> str:
    """The value of the environment variable a setting names; unset or empty is a ConfigError."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"{section}.{setting}: environment variable {name} is not set")
    return value


def _read(file: Path | None, env: str | None, kind: str, section: str = "gateway.auth") -> tuple[bytes, ...]:
    """The keys of `{section}.{kind}_keys_file` and `..._keys_env`."""
    keys: list[str] = []
    if file is not None:
        try:
            lines = file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"{section}.{kind}_keys_file: cannot read {file}: {exc.strerror}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise ConfigError(f"{section}.{kind}_keys_file: {file} holds no keys")
    if env is not None:
        from_env = [k.strip() for k in env_setting(env, f"{kind}_keys_env", section).split(",") if k.strip()]
        if not from_env:   # e.g. " , ": set, yet zero keys would leave the gateway open
            raise ConfigError(f"{section}.{kind}_keys_env: environment variable {env} holds no keys "
                              "(only separators)")
        keys += from_env
    return tuple(k.encode() for k in keys)


def _tenant_keys(tenants: TenantsConfig, taken: dict[bytes, str]) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    """Every tenant's keys and, in the same order, whose each is. A key given twice (two tenants, or a
    tenant and gateway.auth) is a ConfigError: whose it is would be a guess."""
    keys: list[bytes] = []
    owners: list[str] = []
    for name, spec in tenants.teams.items():
        for key in dict.fromkeys(_read(spec.api_keys_file, spec.api_keys_env, "api", f"gateway.tenants.teams.{name}")):
            if key in taken:   # (a key repeated in one tenant's own list is that tenant's once)
                raise ConfigError(f"gateway.tenants.teams.{name}: one of its keys is also a key of {taken[key]}; "
                                  "a key belongs to one tenant")
            taken[key] = f"tenant {name!r}"
            keys.append(key)
            owners.append(name)
    return tuple(keys), tuple(owners)


@dataclass(frozen=True)
class KeyRing:
    user: tuple[bytes, ...]
    admin: tuple[bytes, ...]
    tenant_keys: tuple[bytes, ...] = ()
    tenant_of: tuple[str, ...] = ()    # the tenant of each of `tenant_keys`

    @classmethod
    def load(cls, config: AuthConfig, tenants: TenantsConfig | None = None) -> KeyRing:
        user = _read(config.api_keys_file, config.api_keys_env, "api")
        admin = _read(config.admin_keys_file, config.admin_keys_env, "admin")
        if set(user) & set(admin):   # one file or variable for both made every user an admin, silently
            raise ConfigError("gateway.auth: a key is both an API key and an admin key; an admin key already "
                              "serves requests, so list it under admin_keys only (every holder of a key in both "
                              "may add, drain and remove backends)")
        taken = dict.fromkeys(user, "gateway.auth.api_keys") | dict.fromkeys(admin, "gateway.auth.admin_keys")
        return cls(user, admin, *_tenant_keys(tenants or TenantsConfig(), taken))

    @property
    def enabled(self) -> bool:
        return bool(self.user or self.admin or self.tenant_keys)

    def check(self, authorization: str | None, *, admin: bool) -> str:
        """The tenant of the header's key (`default` for a key of no tenant, and with keys off); raise
        Unauthorized unless it carries a valid key, and Forbidden for a valid key that is not an admin
        key when `admin`."""
        if not self.enabled:
            return DEFAULT_TENANT
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        candidate = token.strip().encode()
        match = False
        for key in self.admin if admin else self.user + self.admin:
            match |= hmac.compare_digest(candidate, key)   # no early exit: the time does not tell which key
        tenant = DEFAULT_TENANT
        if admin:
            if not match:   # a valid key of a user or tenant may not: 403; no valid key: 401
                user = False
                for key in self.user + self.tenant_keys:
                    user |= hmac.compare_digest(candidate, key)
                if user:
                    raise Forbidden("this route needs an admin API key; the key sent is a user's")
                raise Unauthorized("admin API key required")
            return tenant
        for key, name in zip(self.tenant_keys, self.tenant_of, strict=True):
            hit = hmac.compare_digest(candidate, key)
            match |= hit
            tenant = name if hit else tenant
        if not match:
            raise Unauthorized("invalid API key")
        return tenant

"""Managed engines' identities, checkable by every replica: each secret is known to the others by digest.

A managed engine proves it is the backend it heartbeats for with a secret that the replica launching
it put in its environment (control_auth.py). With several replicas (`--workers` on one SO_REUSEPORT
control port, or replicas behind a list of control addresses) the heartbeat may land on any of them,
so every replica must be able to check it, not only the launcher:

- each replica draws one random secret (256 bits) per managed backend at start-up;
- the replica that launches the engines (the leader) announces the SHA-256 digests of its secrets
  under `P identities`, with every lease renewal and in the same holder-checked script
  (leadership.py), so a replica that has lost the lease cannot overwrite them;
- every other replica reads the digests on each shared-state refresh (shared_state.py) and admits a
  heartbeat whose identity hashes to the announced digest.

The leader's renewal replaces the whole hash and sets its expiry (`engine_keys_ttl_s`, longer than
engines outlive every replica, `engine_orphan_s`): digests of backends no longer managed (`forget`) leave
with the next renewal (the whole hash when none is left), and those of a deployment no longer running
leave Redis with the expiry, while each replica keeps the digests it last read (a Redis outage or a gap
between leaders changes nothing here).

Redis holds digests, never secrets: reading Redis does not let anyone speak for an engine (writing to
it already allows writing heartbeats, so Redis is inside the trust boundary either way). The
launcher uses its own digests from the moment it leads and ignores what Redis says meanwhile; a
replica that has not yet read a backend's digest refuses its heartbeats, and the engine retries.
A new leader that adopts the running engines of the previous one (gateway/control/adoption.py) keeps
their announced digests in effect, and announces them, until it launches an engine of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class EngineIdentities:
    def __init__(self, own_secrets: Mapping[str, str] | None = None, *, launching: bool = True) -> None:
        """`own_secrets`: managed backend id -> the secret this replica gives the engine it launches.
        `launching`: whether this replica launches them now (a single gateway always does)."""
        self._secrets = dict(own_secrets or {})
        self.own = {b: digest(s) for b, s in self._secrets.items()}   # its own engines' digests
        self.launching = launching
        self._digests = dict(self.own) if launching else {}

    @classmethod
    def drawn(cls, managed: Iterable[str], *, launching: bool = True) -> EngineIdentities:
        return cls({backend_id: secrets.token_urlsafe(32) for backend_id in managed}, launching=launching)

    def draw(self, backend_id: str) -> None:
        """A managed backend added at runtime (gateway/control/fleet.py): a secret of its own."""
        self._secrets[backend_id] = secret = secrets.token_urlsafe(32)
        self.own[backend_id] = digest(secret)
        if self.launching:
            self._digests[backend_id] = self.own[backend_id]

    def forget(self, backend_id: str) -> None:
        """A managed backend removed at runtime, its engine stopped (gateway/control/fleet.py): its secret and
        digest go, so the leader's next renewal no longer announces it (nor one it adopted)."""
        self._secrets.pop(backend_id, None)
        self.own.pop(backend_id, None)
        self._digests.pop(backend_id, None)

    def __contains__(self, backend_id: str) -> bool:
        return backend_id in self._secrets

    def secret(self, backend_id: str) -> str:
        return self._secrets[backend_id]

    @property
    def announced(self) -> Mapping[str, str]:
        """What this replica announces while it leads: the digests in effect (live)."""
        return self._digests

    def set_launching(self, launching: bool, keep: Iterable[str] = ()) -> None:
        """This replica starts (True) or stops (False) launching the engines; `keep`: backends whose
        engines it adopts, whose announced digests stay in effect until it launches them (`launched`)."""
        self.launching = launching
        if launching:
            kept = set(keep)
            self._digests.update({b: d for b, d in self.own.items() if b not in kept})

    def launched(self, backend_id: str) -> None:
        """This replica launches `backend_id`'s engine, with its own secret."""
        self._digests[backend_id] = self.own[backend_id]

    def adopt(self, announced: Mapping[str, str]) -> None:
        """The digests the leader announced (read from Redis); ignored while this replica launches."""
        if self.launching:
            return
        for backend_id, value in announced.items():
            if backend_id in self._secrets:
                self._digests[backend_id] = value

    def verify(self, backend_id: str, given: str) -> bool:
        expected = self._digests.get(backend_id)
        return expected is not None and hmac.compare_digest(digest(given), expected)

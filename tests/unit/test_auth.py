from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import AuthConfig, KeyRing
from gateway.errors import Unauthorized


def ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KeyRing:
    (tmp_path / "keys").write_text("# users\nuser-key-1\n\nuser-key-2\n")
    monkeypatch.setenv("ADMIN_KEYS", "admin-key")
    return KeyRing.load(AuthConfig(api_keys_file=tmp_path / "keys", admin_keys_env="ADMIN_KEYS"))


def test_open_when_no_keys() -> None:
    KeyRing.load(AuthConfig()).check(None, admin=True)


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer ", "Bearer wrong", "bearer user-key-3"])
def test_missing_or_wrong_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header: str | None) -> None:
    with pytest.raises(Unauthorized):
        ring(tmp_path, monkeypatch).check(header, admin=False)


def test_user_and_admin_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ring(tmp_path, monkeypatch)
    keys.check("Bearer user-key-2", admin=False)
    keys.check("Bearer admin-key", admin=False)
    keys.check("Bearer admin-key", admin=True)
    with pytest.raises(Unauthorized, match="admin"):
        keys.check("Bearer user-key-1", admin=True)

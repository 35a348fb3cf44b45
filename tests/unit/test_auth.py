from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ConfigError
from gateway.config.auth import AuthConfig, KeyRing
from gateway.control.control_auth import ControlAuth
from gateway.requests.errors import Forbidden, Unauthorized


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
    with pytest.raises(Forbidden, match="admin"):   # a valid key, not an admin's
        keys.check("Bearer user-key-1", admin=True)
    with pytest.raises(Unauthorized, match="admin"):
        keys.check("Bearer no-such-key", admin=True)


def test_missing_key_sources_stop_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEYS", raising=False)
    with pytest.raises(ConfigError, match=r"gateway\.auth\.api_keys_env: environment variable NO_SUCH_KEYS"):
        KeyRing.load(AuthConfig(api_keys_env="NO_SUCH_KEYS"))
    with pytest.raises(ConfigError, match=r"gateway\.auth\.admin_keys_file: cannot read"):
        KeyRing.load(AuthConfig(admin_keys_file=tmp_path / "absent"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"gateway\.auth\.api_keys_file: .* holds no keys"):
        KeyRing.load(AuthConfig(api_keys_file=tmp_path / "empty"))


def test_cluster_token_required_with_keys_or_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"gateway\.auth\.cluster_token_env: environment variable NO_SUCH_TOKEN"):
        ControlAuth.load(AuthConfig(cluster_token_env="NO_SUCH_TOKEN"), managed=[], api_keys_on=False,
                         control_host="127.0.0.1")
    for keys_on, host in ((True, "127.0.0.1"), (False, "0.0.0.0"), (False, "10.1.2.3"), (False, "gw.example")):
        with pytest.raises(ConfigError, match="cluster_token_file or cluster_token_env is required"):
            ControlAuth.load(AuthConfig(), managed=[], api_keys_on=keys_on, control_host=host)
    open_auth = ControlAuth.load(AuthConfig(), managed=["a", "b"], api_keys_on=False, control_host="::1")
    assert open_auth.token is None and len({open_auth.identities.secret(b) for b in "ab"}) == 2   # one per engine
    monkeypatch.setenv("TOKEN", "t0k")
    auth = ControlAuth.load(AuthConfig(cluster_token_env="TOKEN"), managed=["a"], api_keys_on=True,
                            control_host="0.0.0.0")
    assert auth.engine_env("a")["HETEROGATE_CLUSTER_TOKEN"] == "t0k"


@pytest.mark.parametrize("setting", ["api_keys_env", "admin_keys_env"])
@pytest.mark.parametrize("value", [" , ", ",", " ,, , "])
def test_keys_env_of_only_separators_stops_start_up(monkeypatch: pytest.MonkeyPatch, setting: str, value: str) -> None:
    """A variable that is set but holds no key would turn auth off without a word: it is refused, named."""
    monkeypatch.setenv("ONLY_SEPARATORS", value)
    with pytest.raises(ConfigError, match=rf"gateway\.auth\.{setting}: environment variable ONLY_SEPARATORS holds "
                                          "no keys"):
        KeyRing.load(AuthConfig(**{setting: "ONLY_SEPARATORS"}))


def test_a_key_in_both_the_api_and_the_admin_keys_is_refused(tmp_path: Path) -> None:
    """The same file for both made every user key an admin key, with no word."""
    (tmp_path / "keys").write_text("sk-one\nsk-two\n")
    with pytest.raises(ConfigError, match="both an API key and an admin key"):
        KeyRing.load(AuthConfig(api_keys_file=tmp_path / "keys", admin_keys_file=tmp_path / "keys"))

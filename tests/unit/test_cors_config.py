"""`gateway.cors` in backends.yaml: origins as browsers send them, and the settings CORS forbids refused at
load with the file and the field named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config.cluster import load_cluster
from gateway.config.sections import CorsConfig
from tests.config_files import config_error, write
from tests.snapshots import catalog

BACKEND = "backends:\n  - {id: a, gpu: H100, launch: {}}\n"


def cors(tmp_path: Path, section: str) -> Path:
    return write(tmp_path, f"gateway:\n  cors: {section}\n{BACKEND}")


def test_off_by_default_with_the_gateways_own_headers(tmp_path: Path) -> None:
    settings = load_cluster(write(tmp_path, BACKEND), catalog()).settings.cors
    assert settings.allow_origins == [] and not settings.allow_credentials and settings.max_age_s == 600
    assert settings.allow_methods == ["GET", "POST", "DELETE"]
    assert settings.allow_headers == ["authorization", "content-type", "x-request-id", "x-request-timeout",
                                      "x-session-id", "traceparent", "tracestate", "x-stainless-*"]
    assert settings.expose_headers == ["x-request-id", "x-heterogate-backend", "x-heterogate-vision-backend",
                                       "retry-after", "x-should-retry"]


def test_origins_are_kept_as_browsers_send_them(tmp_path: Path) -> None:
    path = cors(tmp_path, "{allow_origins: ['HTTPS://App.Example.com:443', 'http://localhost:5173', "
                          "'http://[::1]:8080', 'http://10.0.0.2:80', 'https://app.example.com', '*'], "
                          "allow_methods: [get, post], allow_headers: [X-Custom, Authorization]}")
    settings = load_cluster(path, catalog()).settings.cors
    assert settings.allow_origins == ["https://app.example.com", "http://localhost:5173", "http://[::1]:8080",
                                      "http://10.0.0.2", "*"]
    assert settings.allow_methods == ["GET", "POST"] and settings.allow_headers == ["x-custom", "authorization"]
    path = cors(tmp_path, "{allow_origins: ['*'], allow_headers: ['*', 'X-Stainless-*'], expose_headers: ['*']}")
    settings = load_cluster(path, catalog()).settings.cors
    assert settings.allow_headers == ["*", "x-stainless-*"] and settings.expose_headers == ["*"]


@pytest.mark.parametrize(("origin", "words"), [
    ("app.example.com", r"origin 'app.example.com' is not scheme://host\[:port\]"),
    ("null", r"origin 'null' is not scheme://host\[:port\]"),
    ("https://app.example.com/", r"has a path, query or fragment: an origin is scheme://host\[:port\] only"),
    ("https://app.example.com/v1", r"has a path, query or fragment"),
    ("https://app.example.com?x=1", r"has a path, query or fragment"),
    ("https://*.example.com", r"a wildcard such as \*\.example\.com is not supported"),
    ("https://user@app.example.com", r"is no host name or address"),
    ("https://app.example.com:99999", r"the port is not a number from 1 to 65535"),
    ("https://app.example.com:0", r"has an empty or zero port"),
])
def test_bad_origins_are_config_errors(tmp_path: Path, origin: str, words: str) -> None:
    path = cors(tmp_path, f"{{allow_origins: ['{origin}']}}")
    message = config_error(path)
    assert re.search(re.escape(f"{path}: gateway.cors.allow_origins") + r".*" + words, message), message


def test_credentials_with_every_origin_are_refused(tmp_path: Path) -> None:
    path = cors(tmp_path, "{allow_origins: ['*'], allow_credentials: true}")
    message = config_error(path)
    assert f"{path}: gateway.cors: " in message
    assert 'allow_credentials: true cannot go with allow_origins "*"' in message and "list the origins" in message
    # exact origins with credentials are fine; so is "*" without them
    load_cluster(cors(tmp_path, "{allow_origins: ['https://a.example'], allow_credentials: true}"), catalog())
    load_cluster(cors(tmp_path, "{allow_origins: ['*']}"), catalog())


def test_other_bad_values_are_config_errors(tmp_path: Path) -> None:
    for section, words in (
        ("{allow_origins: ['*'], allow_headers: ['x bad']}", r"gateway\.cors\.allow_headers: .*header 'x bad' is not"),
        ("{allow_origins: ['*'], allow_methods: ['PO ST']}", r"gateway\.cors\.allow_methods: .*method 'PO ST' is not"),
        ("{allow_origins: ['*'], allow_methods: ['P*']}", r"gateway\.cors\.allow_methods: .*method 'P\*' is not"),
        ("{allow_origins: ['*'], allow_headers: ['x-*-id']}", r"allow_headers: .*'x-\*-id' is not .* x-stainless"),
        ("{allow_origins: ['*'], expose_headers: ['x-heterogate-*']}", r"expose_headers: .*'x-heterogate-\*' is not"),
        ("{allow_origins: ['*'], max_age_s: -1}", r"gateway\.cors\.max_age_s: Input should be greater than or equal"),
        ("{allow_origins: ['https://a.example'], allow_credentials: true, expose_headers: ['*']}",
         r'gateway\.cors: .*cannot go with expose_headers "\*"'),
        ("{allow_origin: ['*']}", r"gateway\.cors\.allow_origin: Extra inputs are not permitted"),
    ):
        path = cors(tmp_path, section)
        assert re.search(words, config_error(path)), section


def test_the_model_alone_refuses_credentials_with_a_star() -> None:
    with pytest.raises(ValueError, match="allow_credentials"):
        CorsConfig(allow_origins=["*"], allow_credentials=True)

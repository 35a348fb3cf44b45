"""The retry headers of a 429: `x-should-retry: false` exactly where the wait a client is told is past what
OpenAI's SDKs honour (a minute), judged on the whole seconds sent, not the unrounded wait."""

from __future__ import annotations

import pytest

from gateway.doors.client_errors import error_headers
from gateway.requests.errors import RequestError


class _Limited(RequestError):
    status = 429
    type = "rate_limit_error"


@pytest.mark.parametrize(("wait_s", "sent", "no_retry"), [
    (None, None, True), (0.2, b"1", False), (60.0, b"60", False), (60.3, b"60", False), (60.6, b"61", True),
    (3600.0, b"3600", True),
])
def test_should_retry_follows_the_retry_after_sent(wait_s: float | None, sent: bytes | None, no_retry: bool) -> None:
    err = _Limited("over the limit")
    err.retry_after_s = wait_s
    headers = dict(error_headers(err, "req-1"))
    assert headers.get(b"retry-after") == sent
    assert (headers.get(b"x-should-retry") == b"false") is no_retry

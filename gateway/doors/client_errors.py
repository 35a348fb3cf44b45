"""What a client is told of an error, on both doors.

A backend's failure reaches the client as which backend failed, in the gateway's words. The text the
transport wrote (gRPC's "<AioRpcError of RPC that terminated with ...>", "failed to connect to all
addresses; ... Failed to connect to remote host", "Cancelling all calls", an OSError naming an
internal address) says nothing a client can act on and names the cluster's insides: it goes to the
request's log line (under the `x-request-id` the client also gets), never into a response. An
upstream's 429 is the exception: it is no failure but the engine asking the client to wait, so the
client is told that, with the upstream's own message (written for its clients) where it gave one.

Every HTTP route answers an error with `error_headers` and `error_json`: the OpenAI error shape, the
request's id, `retry-after` where the error has one, and `x-should-retry: false` on a 429 that no retry
of OpenAI's SDKs could pass.
"""

from __future__ import annotations

import orjson

from gateway.clients.engine_client import HANDOFF_TIMEOUT
from gateway.clients.openai_upstream import UpstreamRateLimited
from gateway.requests.errors import (
    BackendDrained,
    BackendFailure,
    BackendTimeout,
    DeadlineExceeded,
    RequestError,
    openai_error_body,
)

_LAST_ERROR = "; last error: "   # how the pipeline appends a deadline's last backend failure


def client_message(err: RequestError) -> str:
    """The message a client gets for `err`. Timeouts and drains keep theirs: the gateway wrote them (the
    first token's or the request's deadline, a drain's end), as it wrote every error of a request itself."""
    if isinstance(err, UpstreamRateLimited):
        said = err.said.strip()
        return f"backend {err.backend_id} {err.doing}" + (f": {said}" if said else "")
    if isinstance(err, BackendFailure) and not isinstance(err, BackendTimeout | BackendDrained):
        who = f"backend {err.backend_id}" if err.backend_id else "a backend"
        if err.code == HANDOFF_TIMEOUT:
            return f"{who} failed: the image embeddings did not reach the language backend in time"
        return f"{who} failed or could not be reached; the request could not be completed there"
    if isinstance(err, DeadlineExceeded):
        return err.message.partition(_LAST_ERROR)[0]
    return err.message


def client_view(err: RequestError) -> RequestError:
    """`err` as the client sees it: the same status, type, code and param, with `client_message`."""
    message = client_message(err)
    if message == err.message:
        return err
    view = RequestError(message, param=err.param, code=err.code)
    view.status, view.type, view.retry_after_s = err.status, err.type, err.retry_after_s
    return view


# OpenAI's SDKs retry a 429 by themselves (twice by default): after its Retry-After when that is at most
# this long, else after their own backoff of a few seconds. A 429 with no Retry-After (a request over a
# limit by itself) or a longer one (a daily budget spent) cannot pass on such a retry: it would come back
# refused, counted again in the tenant's refusals. `x-should-retry: false` is the header they obey instead.
_SDK_RETRY_AFTER_MAX_S = 60.0


def retry_after(err: RequestError) -> int | None:
    """The whole seconds a client should wait before retrying `err` (HTTP's `Retry-After`, the gRPC door's
    `retry-after` trailer); None when the error names no wait."""
    return None if err.retry_after_s is None else max(1, round(err.retry_after_s))


def error_headers(err: RequestError, request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", request_id.encode())]
    wait_s = retry_after(err)
    if wait_s is not None:
        headers.append((b"retry-after", b"%d" % wait_s))
    if err.status == 429 and (wait_s is None or wait_s > _SDK_RETRY_AFTER_MAX_S):   # the wait as sent
        headers.append((b"x-should-retry", b"false"))
    return headers


def error_json(err: RequestError) -> bytes:
    """The body of an HTTP error response: `client_view(err)` in the OpenAI error shape."""
    return orjson.dumps(openai_error_body(client_view(err)))

"""One error hierarchy for the gateway, and the one place that turns an error into a response.

    HeteroGateError
    ├── ConfigError                  bad backends.yaml / catalog (names the file and the field)
    └── RequestError                 anything a client can get back
        ├── InvalidRequest           400  malformed body, wrong types, over a limit
        │   └── PayloadTooLarge      413  body over max_body_bytes
        ├── ModelNotFound            404  unknown model
        ├── Unauthorized             401
        ├── Forbidden                403  a valid key without the right (a user key on an admin route)
        ├── Overloaded               429  admission or overload queue full, or no start in time (Retry-After)
        ├── RateLimited              429  a tenant over its limit (Retry-After; OpenAI's type requests/tokens)
        ├── LimiterUnavailable       503  a tenant's limits cannot be checked (Redis away, fail-closed)
        ├── NoBackendAvailable       503  no healthy backend for the pool (Retry-After)
        ├── ShuttingDown             503  still under way when the gateway's drain time ran out
        ├── BackendFailure           502  the engine failed; `retryable` while no token was sent
        │   ├── BackendTimeout       504
        │   └── UpstreamRateLimited  429  a kind: openai upstream's 429 (gateway.clients.openai_upstream)
        │       └── UpstreamUnavailable  503  its 503 with a Retry-After
        └── DeadlineExceeded         504  the request's own deadline passed (retries included)

Lower-layer errors (grpc.aio.AioRpcError, OSError) are mapped to these at the boundary in
`engine_client.py`; the HTTP door renders them with `openai_error_body`.
"""

from __future__ import annotations

from typing import Any

from common.errors import HeteroGateError


class RequestError(HeteroGateError):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    retry_after_s: float | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(RequestError):
    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "payload_too_large"


class MethodNotAllowed(InvalidRequest):
    status = 405


class UnsupportedMediaType(InvalidRequest):
    status = 415
    code = "unsupported_media_type"


class ModelNotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class Unauthorized(RequestError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(RequestError):
    """A valid key that may not do this (a user or tenant key on an admin route)."""

    status = 403
    type = "permission_error"
    code = "admin_key_required"


class Overloaded(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"
    retry_after_s = 1.0

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class RateLimited(RequestError):
    """A tenant over one of its limits, as OpenAI answers it: `type` is "requests" or "tokens"."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.type = kind
        self.retry_after_s = retry_after_s


class LimiterUnavailable(RequestError):
    status = 503
    type = "service_unavailable"
    code = "rate_limiter_unavailable"
    retry_after_s = 1.0


class NoBackendAvailable(RequestError):
    status = 503
    type = "service_unavailable"
    code = "no_backend_available"
    retry_after_s = 1.0


class ShuttingDown(RequestError):
    """The gateway stops and its drain time is over: a request still under way is ended with this."""

    status = 503
    type = "service_unavailable"
    code = "gateway_shutting_down"
    retry_after_s = 1.0


class BackendFailure(RequestError):
    status = 502
    type = "backend_error"
    code = "backend_failure"

    def __init__(self, message: str, *, backend_id: str, retryable: bool = True, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.backend_id = backend_id
        self.retryable = retryable


class BackendDrained(BackendFailure):
    """A backend drained at runtime (gateway/control/fleet.py) ended a request under way: its drain's
    time ran out. The gateway's own words: the client is told what happened, and to send it again."""

    code = "backend_drained"


class BackendTimeout(BackendFailure):
    status = 504
    code = "backend_timeout"


class DeadlineExceeded(RequestError):
    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


# HTTP status of a RequestError → the gRPC status code the gRPC door answers with.
GRPC_CODES = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def grpc_code_name(err: RequestError) -> str:
    return GRPC_CODES.get(err.status, "INTERNAL")


def http_error(status: int, message: str) -> RequestError:
    """An error that has only an HTTP status (the server's 4xx for a request it could not read, a
    framework's 404 or 405): the error of that status, `invalid_request_error` below 500."""
    err = PayloadTooLarge(message) if status == PayloadTooLarge.status else RequestError(message)
    err.status = status
    if status < 500:
        err.type = "invalid_request_error"
    return err


def openai_error_body(err: RequestError) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}

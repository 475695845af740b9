"""Errors the gateway answers with, in the OpenAI / vLLM error shape.

Body: `{"error": {"message": str, "type": str, "param": str | null, "code": int}}` (vLLM's
`ErrorResponse`), so OpenAI SDKs raise the matching exception class.
"""

from __future__ import annotations

import json
import math

__all__ = [
    "GatewayError",
    "UpstreamReply",
    "bad_gateway",
    "bad_request",
    "error_body",
    "gateway_timeout",
    "not_found",
    "too_many_requests",
    "unauthorized",
    "unavailable",
]

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    *,
    type_: str | None = None,
    code: str | int | None = None,
) -> bytes:
    """The JSON bytes of an OpenAI-style error for HTTP `status` (`type_` and `code` replace
    the defaults: the status's class name and the status)."""
    default_type = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    err = {
        "message": message,
        "type": type_ or default_type,
        "param": param,
        "code": status if code is None else code,
    }
    return json.dumps({"error": err}).encode()


class GatewayError(Exception):
    """An error the gateway itself answers with (never an upstream's own answer).

    Attributes:
        status: HTTP status code.
        message: human-readable reason (goes into `error.message`).
        param: the offending request field, if any.
        headers: extra response headers (e.g. `Retry-After` of a 429).
        type_, code: `error.type` / `error.code` when not the defaults (see `error_body`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.type_ = type_
        self.code = code

    def body(self) -> bytes:
        """OpenAI-style JSON error body (bytes)."""
        return error_body(self.status, self.message, self.param, type_=self.type_, code=self.code)

    def sse_event(self) -> bytes:
        """The error as one SSE event `data: {"error": {...}}\\n\\n` (after streaming began)."""
        return b"data: " + self.body() + b"\n\n"


class UpstreamReply(Exception):
    """An upstream answered with an error status; the gateway passes it through unchanged
    when it is JSON (vLLM's own OpenAI-style errors).

    Attributes:
        status: the upstream's HTTP status (e.g. 400 for `max_tokens` over the model length).
        body: the upstream's body bytes.
        content_type: the upstream's Content-Type.
        source: who answered, for the message of a body that is not JSON (e.g. "prefill
            instance p-0").
    """

    def __init__(self, status: int, body: bytes, content_type: str, source: str = "") -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type
        self.source = source or "the instance"

    def client_body(self) -> tuple[bytes, str]:
        """(body, content type) for the client: the upstream's when it is a JSON object, else
        an OpenAI-style error with the same status quoting its first 300 bytes (a plain-text
        or HTML answer of a proxy or framework in front of the engine)."""
        try:
            if isinstance(json.loads(self.body), dict):
                return self.body, self.content_type or "application/json"
        except ValueError:  # not JSON (UnicodeDecodeError is a ValueError too)
            pass
        excerpt = self.body[:300].decode(errors="replace")
        message = f"{self.source} answered {self.status}: {excerpt}"
        return error_body(self.status, message), "application/json"


def bad_request(message: str, param: str | None = None) -> GatewayError:
    """400: malformed JSON, wrong type or missing field (the gateway's own validation)."""
    return GatewayError(400, message, param)


def unauthorized() -> GatewayError:
    """401: missing or invalid bearer token (`--api-key`)."""
    return GatewayError(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')")


def not_found(model: str) -> GatewayError:
    """404: no instance of `model` is registered."""
    return GatewayError(404, f"The model `{model}` does not exist.", "model")


def unavailable(message: str) -> GatewayError:
    """503: no compatible prefill or decode instance (the message names the missing side)."""
    return GatewayError(503, message)


def bad_gateway(message: str) -> GatewayError:
    """502: an instance was unreachable or answered something unusable."""
    return GatewayError(502, message)


def gateway_timeout(message: str) -> GatewayError:
    """504: an instance did not answer within `--upstream-timeout-s`."""
    return GatewayError(504, message)


def too_many_requests(message: str, retry_after_s: float, type_: str) -> GatewayError:
    """429 with `Retry-After` (whole seconds, rounded up, at least 1) and OpenAI's rate-limit
    body: `error.type` = `type_` ("requests", "tokens" for a key's rate limit; "overloaded"
    for a request shed from the queue), `error.code` = "rate_limit_exceeded"."""
    seconds = max(1, math.ceil(retry_after_s))
    return GatewayError(
        429,
        f"{message} Please try again in {seconds}s.",
        headers={"retry-after": str(seconds)},
        type_=type_,
        code="rate_limit_exceeded",
    )

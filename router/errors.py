"""Errors that carry their HTTP status: raised anywhere below the ingress (the AdapterStore,
the replica's admission), they reach the client as OpenAI-style error bodies.

Plain Python, no Ray: an exception raised in another actor arrives wrapped by Ray as a
subclass of both RayTaskError and the original class, so `except APIError` still works.
"""

from __future__ import annotations


class APIError(Exception):
    status = 500
    headers: dict[str, str] | None = None  # extra response headers (Retry-After, ...)
    type: str | None = None  # OpenAI's error.type, when not the status's usual one
    code: str | None = None  # OpenAI's error.code, when not the status

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault (OpenAI's error.param), if one is


class BadRequestError(APIError):
    status = 400


class ForbiddenError(APIError):
    status = 403


class NotFoundError(APIError):
    status = 404


class ServiceUnavailableError(APIError):
    status = 503


class UnauthorizedError(APIError):
    status = 401
    headers = {"WWW-Authenticate": "Bearer"}


class TooManyRequestsError(APIError):
    status = 429
    headers = {"Retry-After": "1"}


class GatewayTimeoutError(APIError):
    status = 504

"""Errors that carry their HTTP status, and the one mapping of a replica's refusals to them.

Raised anywhere below the ingress (the AdapterStore, the ingress itself), they reach the
client as OpenAI-style error bodies. A replica raises the exceptions of replica/errors.py
instead, which know no HTTP: `refusal_error` turns one into its status here. Plain
Python, no Ray: an exception raised in another actor arrives wrapped by Ray as a subclass
of both RayTaskError and the original class, so `except APIError` (or `except
RequestRefused`) still works.
"""

from __future__ import annotations

from replica.errors import DeadlineExceeded, NotFound, RequestError, RequestRefused


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


class NotFoundError(APIError, NotFound):
    """Also a replica's NotFound: the AdapterStore raises it for a version it no longer
    has, and a replica that asked for that version refuses its request with it."""

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


# A replica's refusals by kind (replica/errors.py); any other, Unavailable included: 503.
_REFUSALS: tuple[tuple[type[RequestRefused], type[APIError]], ...] = (
    (RequestError, BadRequestError),
    (NotFound, NotFoundError),
    (DeadlineExceeded, GatewayTimeoutError),
)


def refusal_error(refusal: RequestRefused) -> APIError:
    """The HTTP error a replica's refusal (as raised, or wrapped by Ray) is answered with."""
    error = next((e for kind, e in _REFUSALS if isinstance(refusal, kind)), None)
    return (error or ServiceUnavailableError)(refusal.message)

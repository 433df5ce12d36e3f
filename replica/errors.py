"""Why a replica refuses a request, or stops serving it: the exceptions both sides import.

Torch-free and HTTP-free. A replica raises them from `LoRAReplica.generate`; Ray hands the
ingress a RayTaskError that is also an instance of the class raised (its `cause` is the
exception itself), and router/errors.py maps each class to its HTTP status, in one place.
Inside the replica, every layer may raise RequestError about the request it was given.
"""

from __future__ import annotations


class RequestRefused(Exception):
    """A request a replica will not serve, or can no longer: the subclass says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RequestError(RequestRefused, ValueError):
    """A request the engine cannot serve (unknown adapter, too long, a bad grammar, ...):
    the caller's problem, never a failure of the replica."""


class NotFound(RequestRefused):
    """The adapter version the request names is no longer registered (unloaded, replaced)."""


class Unavailable(RequestRefused):
    """The replica cannot serve it now: the adapter store did not answer, the engine failed
    mid-generation, or it shut down."""


class DeadlineExceeded(RequestRefused):
    """The request ran past its `timeout_s`; the replica aborted it (KV and slot freed)."""

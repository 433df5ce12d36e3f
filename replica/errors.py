"""Errors every layer of a replica may raise about a request (torch-free)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve (unknown adapter, too long, ...): the caller's
    problem, answered with a 400, never a failure of the replica."""

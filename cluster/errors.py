"""The error of a Serve config that cannot be read or deployed, in a module of its own:
serving, preflight and ports each raise it, and none of them imports another for it."""

from __future__ import annotations


class ServeConfigError(ValueError):
    """A Serve config file that cannot be read or deployed. Its message may hold several
    lines, one per problem (each bad field of a config)."""

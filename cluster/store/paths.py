"""Where the store may read adapters from: the configured adapter roots, or a tenant's own.

A path and every file the store or the ingress will read from it (adapter_config.json, the
weights, the tokenizer files and chat template) must lie inside a root, symlinks resolved:
no traversal, no symlink out of the roots.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from replica.model.adapter_weights import WEIGHTS_FILES
from router.errors import BadRequestError

# read by adapter_tokens.py (here) and for the adapter's chat template (the ingress)
TOKENIZER_FILES = ("chat_template.jinja", "tokenizer_config.json", "added_tokens.json",
                   "tokenizer.json")  # fmt: skip
DISABLED = "loading adapters at runtime is disabled: no adapter_roots are configured"


class AdapterRoots:
    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = [Path(r).resolve() for r in roots]

    def check(self, path: str, roots: Sequence[Path] | None = None) -> Path:
        """`path`, resolved, once it and the files read from it lie inside one of `roots`
        (default: the adapter roots); BadRequestError naming the problem otherwise."""
        if roots is None:
            roots = self.roots
            if not roots:
                raise BadRequestError(DISABLED)
        try:
            resolved = Path(path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
            raise BadRequestError(f"adapter path {path!r} does not exist") from None
        names = ["adapter_config.json", *WEIGHTS_FILES, *TOKENIZER_FILES]
        files = [resolved / name for name in names]
        for p in [resolved, *(f.resolve() for f in files if f.exists())]:
            if not any(p.is_relative_to(root) for root in roots):
                shown = ", ".join(str(r) for r in roots)
                raise BadRequestError(
                    f"adapter path {path!r} is outside the configured adapter roots ({shown})"
                )
        return resolved

    def tenant_roots(self, roots: Sequence[str]) -> list[Path]:
        """A tenant's roots, resolved; each must lie inside the adapter roots."""
        if not self.roots:
            raise BadRequestError(DISABLED)
        own = [Path(r).resolve() for r in roots]
        for root in own:
            if not any(root.is_relative_to(r) for r in self.roots):
                raise BadRequestError(f"tenant adapter root {str(root)!r} is outside adapter_roots")
        return own

"""Every private Ray symbol the project uses, named here with why (the one place that
does): Ray changes its private modules between releases without notice, so each use is
a known risk at an upgrade. A new use fails this test until it is listed, and a listed
use that is gone fails it too, so the list stays the truth.

Found by reading the code: imports and attribute chains rooted in a `ray` module whose
path has a component starting with `_` (`ray._private`, `ray.serve._private`,
`ray.serve.context._get_global_client`), and string constants naming one (a logger).
A private method called on a Ray object (not a module) cannot be found that way: those
are listed in ON_OBJECTS and checked by their text.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("cluster", "router", "replica", "kernels", "tests", "benchmarks")

# (file, the private part of the dotted name) -> why it is used
PRIVATE = {
    ("cluster/serving.py", "ray.serve._private"): (
        "serve_api.serve_start + client.deploy_apps(_blocking=False): what `serve deploy` "
        "does, from Python, with our own wait that names a failed deployment's root cause "
        "(serve.run takes one application, not a config of several with HTTP options)"
    ),
    ("cluster/serving.py", "ray.serve.context._get_global_client"): (
        "the running Serve instance's HTTP address and deployed configs, checked before a "
        "deploy (a port or app name taken); no public API returns them"
    ),
    ("cluster/serving.py", "ray._private"): (
        "ray._private.worker._global_node: this node's log directory, shown where a "
        "replica failed (no public accessor); and the name of the logger that announces "
        "token authentication at every start, quieted"
    ),
    ("router/streams.py", "ray.serve.context._set_request_context"): (
        "a Serve internal request id per handle call of a batch of prompts: calls that "
        "share the HTTP request's id collide in Serve's request router and one never "
        "reaches a replica"
    ),
    ("tests/cluster/test_serve_app.py", "ray.serve.context._get_global_client"): (
        "Serve's own view of a deployment's config, compared with what was asked"
    ),
    ("tests/cluster/test_serving_config.py", "ray.serve._private"): (
        "monkeypatched serve_start: a deploy refused before Serve would start"
    ),
    ("tests/reliability/test_multinode.py", "ray.serve.context._get_global_client"): (
        "where Serve placed each replica (node ids)"
    ),
    ("tests/reliability/test_redeployed.py", "ray.serve.context._get_global_client"): (
        "the deployed app's args: whether the module's settings are deployed already"
    ),
}

# (file, text of the call) -> why: private methods on Ray objects
ON_OBJECTS = {
    ("replica/serve/metrics.py", "self.counter._record(0.0"): (
        "ray.util.metrics.Counter exports a counter only once it holds a value and inc() "
        "refuses 0: recording the zero makes every documented counter exist from the start"
    ),
}


def _private(dotted: str) -> str | None:
    """`dotted` up to its first private component (None if it has none)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[: i + 1])
    return None


def _uses(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, str] = {}  # local name -> the ray module or symbol it is
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ray":
                    names[a.asname or "ray"] = a.name if a.asname else "ray"
                    found.add(_private(a.name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
                found.add(_private(f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, root = [], node
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in names:
                found.add(_private(".".join([names[root.id], *reversed(chain)])))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("ray."):
                found.add(_private(node.value))
    return found - {None}


def test_every_private_ray_symbol_in_use_is_listed_with_why():
    used = {
        (str(path.relative_to(ROOT)), symbol)
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != Path(__file__).resolve()
        for symbol in _uses(path)
    }
    assert used - PRIVATE.keys() == set(), "private Ray symbols not listed in PRIVATE"
    assert PRIVATE.keys() - used == set(), "listed in PRIVATE but no longer used"
    for (file, text), why in ON_OBJECTS.items():
        assert text in (ROOT / file).read_text(), f"{file}: {text!r} is gone ({why})"

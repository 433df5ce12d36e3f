"""The architecture, checked: the project's import graph has no cycle and no upward arrow.

Every import counts, also those inside functions and under TYPE_CHECKING. The layers
(top to bottom): cluster -> router -> replica -> kernels, with router reaching replica
only through replica.wire and replica.errors (the refusals a replica raises); inside
replica: serve -> engine -> executor -> adapters -> model, and beside them the shared
modules (wire, config, device, errors) that import none of the layers. In tests/, no
module imports a test module: what tests share lives in helper modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "router", "replica", "kernels")
REPLICA_LAYERS = ("serve", "engine", "executor", "adapters", "model")  # top to bottom
REPLICA_SHARED = {"replica", "replica.wire", "replica.config", "replica.device", "replica.errors"}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` names the module)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def layer(module: str) -> tuple[int, ...]:
    """A sortable position: higher imports lower, never the reverse."""
    top = module.split(".")[0]
    rank = {"kernels": 0, "replica": 1, "router": 2, "cluster": 3}[top]
    if top != "replica":
        return (rank,)
    if module in REPLICA_SHARED:
        return (rank, 0)
    sub = module.split(".")[1]
    return (rank, 1 + REPLICA_LAYERS[::-1].index(sub))


def test_the_graph_covers_every_layer(graph):
    for sub in REPLICA_LAYERS:
        assert any(m.startswith(f"replica.{sub}.") for m in graph), sub
    assert "replica.wire" in graph and "kernels.segments" in graph


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components: any component of two or more is a cycle."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_arrows_point_down(graph):
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a)]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_router_reaches_replica_only_through_the_wire_and_its_errors(graph):
    bad = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.startswith("router")
        for b in targets
        if b.startswith("replica") and b not in ("replica", "replica.wire", "replica.errors")
    ]
    assert not bad, bad


def test_kernels_import_nothing_of_ours(graph):
    bad = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.startswith("kernels")
        for b in targets
        if not b.startswith("kernels")
    ]
    assert not bad, bad


def test_the_wire_the_errors_and_the_protocol_load_without_torch():
    modules = "replica.wire, replica.errors, router.protocol"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_top_of_replica_stays_small():
    top = [p.name for p in (ROOT / "replica").glob("*.py")]
    assert len(top) <= 8, top
    assert not [p for p in (ROOT / "cluster").glob("*.py") if p.stem.startswith(("bench", "demo"))]


def imported_test_modules(source: str) -> set[str]:
    """Return the test modules (a `test_*` component in the dotted name) `source` imports.

    A helper two test files share lives in a module of its own (tests/fakes.py,
    tests/net.py, tests/engines.py, ...): importing a test module runs its tests' module
    code again under a second name and ties one test file to another's private choices.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found |= {n for n in names if any(p.startswith("test_") for p in n.split("."))}
    return found


def test_the_detector_sees_every_way_to_import_a_test_module():
    source = (
        "import tests.router.test_api\nfrom tests.cluster import test_dashboard as d\n"
        "from .test_faults import LONG\nfrom tests.fakes import FakeStore\n"
    )
    assert imported_test_modules(source) == {
        "tests.router.test_api",
        "tests.cluster.test_dashboard",
        ".test_faults",
        ".test_faults.LONG",
    }


def test_no_test_imports_from_a_test_module():
    bad = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (found := imported_test_modules(path.read_text()))
    }
    assert not bad, f"move what these share into a helper module: {bad}"

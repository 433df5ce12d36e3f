"""The commands of the README and of the docs (docs/, in their nav's order) run as written:
every `lorafleet` line of their bash blocks parses with the real command line (no synopsis
brackets, no pasted-in pipes), and so does every `python -m benchmarks NAME` line with its
bench's (`python -m benchmarks --help` answers), every `make` target exists, and the quick
offline ones run,
in order and each distinct command once, in a fresh directory: through `main`, the
`lorafleet` entry point, in this process (a Python of their own cost each ~5 s of imports
here, torch and ray: the six took 51-87 s that way, ~33 s this way)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.__main__ import BENCHES, bench
from benchmarks.__main__ import main as benchmarks_main
from cluster.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# Offline and quick on this CPU: run them. The rest (servers, benches, training) only parse.
RUNNABLE = (("demo",), ("demo-assets", "--out"), ("demo-assets", "--trained", "--out"),
            ("generate", "--model", "./demo/model"))  # fmt: skip


def pages() -> list[Path]:
    """README.md, then the docs' pages in their nav's order."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    return [ROOT / "README.md", *(ROOT / "docs" / p for p in re.findall(r"(\S+\.md)$", nav, re.M))]


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """("FILE:LINE", argv) of every command in a page's bash blocks."""
    text, name = page.read_text(), str(page.relative_to(ROOT))
    found = []
    for block in re.finditer(r"```bash\n(.*?)```", text, re.S):
        first = text[: block.start()].count("\n") + 2
        logical, start = "", first
        for offset, line in enumerate(block.group(1).splitlines()):
            if not logical:
                start = first + offset
            logical += line.removesuffix("\\") + " "
            if not line.endswith("\\"):
                found.append((f"{name}:{start}", shlex.split(logical, comments=True)))
                logical = ""
    return found


PAGES = pages()
COMMANDS = [c for page in PAGES for c in commands(page)]
LORAFLEET = [(where, argv) for where, argv in COMMANDS if argv[:1] == ["lorafleet"]]
BENCHMARKS = [(where, argv) for where, argv in COMMANDS
              if argv[:2] == ["python", "-m"] and argv[2].partition(".")[0] == "benchmarks"
              ]  # fmt: skip


def test_the_pages_have_commands():
    assert len(PAGES) > 10 and all(p.is_file() for p in PAGES), PAGES
    assert len(LORAFLEET) > 20
    first_two = [argv for _, argv in commands(ROOT / "README.md")[:2]]
    assert first_two == [["make", "run"], ["make", "test"]]  # a reader's first two; .ci/run's


@pytest.mark.parametrize("where, argv", LORAFLEET, ids=[w for w, _ in LORAFLEET])
def test_every_lorafleet_command_parses(where, argv):
    assert not [a for a in argv if a.startswith("[") or "|" in a], f"{where}: {argv}"
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{where}: {shlex.join(argv)} does not parse")


def test_the_pages_show_the_benchmarks():
    named = {argv[3] if argv[2] == "benchmarks" else argv[2].split(".", 1)[1].replace("_", "-")
             for _, argv in BENCHMARKS}  # fmt: skip
    assert set(BENCHES) <= named, set(BENCHES) - named  # every bench, somewhere
    assert not [argv for _, argv in LORAFLEET if argv[1:2] == ["bench"] and argv[2] != "http"]


@pytest.mark.parametrize("where, argv", BENCHMARKS, ids=[w for w, _ in BENCHMARKS])
def test_every_benchmarks_command_parses(where, argv, capsys):
    """`python -m benchmarks NAME ARGS` (or `benchmarks.NAME`): ARGS parse with NAME's own
    command line, as the bench would; `python -m benchmarks --help` lists them."""
    assert not [a for a in argv if a.startswith("[") or "|" in a], f"{where}: {argv}"
    if argv[2] == "benchmarks" and argv[3:] == ["--help"]:
        assert benchmarks_main(["--help"]) == 0 and "engine" in capsys.readouterr().out
        return
    if argv[2] == "benchmarks":
        name, rest = argv[3], argv[4:]
    else:
        name, rest = argv[2].split(".", 1)[1].replace("_", "-"), argv[3:]
    assert name in BENCHES, f"{where}: no bench {name!r}"
    try:
        harness.parser(bench(name)).parse_args(rest)
    except SystemExit:
        pytest.fail(f"{where}: {shlex.join(argv)} does not parse")


def test_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for where, argv in COMMANDS:
        if argv[:1] == ["make"]:
            assert argv[1] in targets, f"{where}: no make target {argv[1]!r}"


@pytest.mark.slow
def test_the_quick_offline_commands_run(tmp_path, monkeypatch, capsys):
    """demo-assets, generate on what it built, the trained demo offline: as written, each
    what `lorafleet ARGS` runs (its exit status is main's return value), from tmp_path."""
    monkeypatch.chdir(tmp_path)  # the commands' relative paths (./demo) land here
    ran, seen = [], set()
    for where, argv in LORAFLEET:
        if "--tp" in argv or not any(argv[1 : 1 + len(r)] == list(r) for r in RUNNABLE):
            continue  # tensor parallelism starts a Ray: parse-only like the servers
        if tuple(argv) in seen:
            continue  # the README and a page show the same command: it ran once
        seen.add(tuple(argv))
        status = main(argv[1:])
        err = capsys.readouterr().err
        assert status == 0, f"{where}: {shlex.join(argv)}\n{err}"
        ran.append(argv[1])
    assert {"demo", "demo-assets", "generate"} <= set(ran), ran

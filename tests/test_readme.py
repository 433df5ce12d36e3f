"""The README's commands run as written: every `lorafleet` line of its bash blocks parses
with the real command line (no synopsis brackets, no pasted-in pipes), every `make` target
exists, and the quick offline ones run, in order, in a fresh directory: through `main`, the
`lorafleet` entry point, in this process (a Python of their own cost each ~5 s of imports
here, torch and ray: the six took 51-87 s that way, ~33 s this way)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cluster.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Offline and quick on this CPU: run them. The rest (servers, benches, training) only parse.
RUNNABLE = (("demo",), ("demo-assets", "--out"), ("demo-assets", "--trained", "--out"),
            ("generate", "--model", "./demo/model"))  # fmt: skip


def commands() -> list[tuple[int, list[str]]]:
    """(README line, argv) of every command in the README's bash blocks."""
    found = []
    for block in re.finditer(r"```bash\n(.*?)```", README, re.S):
        first = README[: block.start()].count("\n") + 2
        logical, start = "", first
        for offset, line in enumerate(block.group(1).splitlines()):
            if not logical:
                start = first + offset
            logical += line.removesuffix("\\") + " "
            if not line.endswith("\\"):
                found.append((start, shlex.split(logical, comments=True)))
                logical = ""
    return found


COMMANDS = commands()
LORAFLEET = [(line, argv) for line, argv in COMMANDS if argv[:1] == ["lorafleet"]]


def test_the_readme_has_commands():
    assert len(LORAFLEET) > 20


@pytest.mark.parametrize("line, argv", LORAFLEET, ids=[f"line{n}" for n, _ in LORAFLEET])
def test_every_lorafleet_command_parses(line, argv):
    assert not [a for a in argv if a.startswith("[") or "|" in a], f"README line {line}: {argv}"
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"README line {line}: {shlex.join(argv)} does not parse")


def test_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for line, argv in COMMANDS:
        if argv[:1] == ["make"]:
            assert argv[1] in targets, f"README line {line}: no make target {argv[1]!r}"


@pytest.mark.slow
def test_the_quick_offline_commands_run(tmp_path, monkeypatch, capsys):
    """demo-assets, generate on what it built, the trained demo offline: as written, each
    what `lorafleet ARGS` runs (its exit status is main's return value), from tmp_path."""
    monkeypatch.chdir(tmp_path)  # the commands' relative paths (./demo) land here
    ran = []
    for line, argv in LORAFLEET:
        if "--tp" in argv or not any(argv[1 : 1 + len(r)] == list(r) for r in RUNNABLE):
            continue  # tensor parallelism starts a Ray: parse-only like the servers
        status = main(argv[1:])
        err = capsys.readouterr().err
        assert status == 0, f"README line {line}: {shlex.join(argv)}\n{err}"
        ran.append(argv[1])
    assert {"demo", "demo-assets", "generate"} <= set(ran), ran

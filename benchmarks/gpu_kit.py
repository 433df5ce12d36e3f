"""What a bare GPU machine lacks for `.ci/gpu`, staged here and unpacked there.

A lent GPU machine has torch, triton, transformers (with its own dependencies: numpy,
safetensors, tokenizers, huggingface_hub, pyyaml, tqdm) and peft, on Python 3.12, and no
package registry. The GPU bench and the CUDA tests import, beyond that, pydantic
(replica/config.py) and pytest: KIT. Nothing else of ours may reach Ray, FastAPI, httpx,
xgrammar or matplotlib on that path (ABSENT), and `bare` runs a command as that machine
would, refusing them, so a CPU run (`.ci/gpu --dry-run`, which the suite runs) catches an
import that would fail there.

    python -m benchmarks.gpu_kit stage .dev          # `make gpu-kit`: wheels for Python 3.12
    python -m benchmarks.gpu_kit unpack .dev         # there: into a folder; prints its path
    python -m benchmarks.gpu_kit plan                # what the kit holds or would hold
    python -m benchmarks.gpu_kit bare -m MODULE ...  # run MODULE with ABSENT refused
    python -m benchmarks.gpu_kit summary GPU.JSON PYTEST.LOG   # .ci/gpu's last line

The wheels are those of the versions installed in the Python that stages them (the ones
this checkout is tested with), for CPython 3.12 on manylinux2014 x86_64; about 5 MB in all,
far under the 64 MiB a device tool carries.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import runpy
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# distribution -> the top-level module it provides
KIT = {
    "pydantic": "pydantic",
    "pydantic-core": "pydantic_core",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "typing-extensions": "typing_extensions",
    "pytest": "pytest",
    "pluggy": "pluggy",
    "iniconfig": "iniconfig",
    "packaging": "packaging",  # pytest wants a newer one than some transformers installs
    "pygments": "pygments",
}
# top-level modules a bare GPU machine does not have, and the kit does not bring
ABSENT = ("ray", "fastapi", "starlette", "uvicorn", "httpx", "xgrammar", "matplotlib",
          "jsonschema", "openai", "hypothesis", "msgpack", "uvloop", "mkdocs")  # fmt: skip
PYTHON, PLATFORM = "3.12", "manylinux2014_x86_64"
MAX_BYTES = 64 << 20


def pins() -> list[str]:
    """`name==version` of each kit distribution, as installed in this Python."""
    try:
        return [f"{name}=={importlib.metadata.version(name)}" for name in KIT]
    except importlib.metadata.PackageNotFoundError as e:
        message = f"gpu-kit: {e.name} is not installed here: pip install -e '.[test]'"
        raise SystemExit(message) from None


def stage(out: Path) -> list[Path]:
    """Download the kit's wheels into `out` (wheels of other versions there removed)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
         "--python-version", PYTHON, "--platform", PLATFORM, "--dest", str(out), *pins()],
        check=True,
    )  # fmt: skip
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size > MAX_BYTES:
        raise SystemExit(f"gpu-kit: {size / 2**20:.1f} MiB, over {MAX_BYTES >> 20} MiB")
    print(f"gpu-kit: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {out}")
    return wheels


def unpack(kit: Path, site: Path | None = None) -> Path:
    """The kit's wheels unpacked into `site` (a wheel is a zip of its installed files);
    the folder to put on PYTHONPATH."""
    site = site or Path(tempfile.gettempdir()) / "lorafleet-gpu-kit"
    wheels = sorted(kit.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu-kit: no wheels in {kit}: run `make gpu-kit` where pip reaches "
                         "a registry, and carry .dev/ to this machine")  # fmt: skip
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    return site


def plan(kit: Path) -> dict:
    """What the kit holds (the wheels in `kit`) or would hold (this Python's versions)."""
    wheels = sorted(p.name for p in kit.glob("*.whl")) if kit.is_dir() else []
    return {
        "kit": wheels or [f"{name} (not staged: make gpu-kit)" for name in KIT],
        "kit_bytes": sum((kit / w).stat().st_size for w in wheels),
        "python": PYTHON,
        "platform": PLATFORM,
        "refused": list(ABSENT),
    }


def bare(module: str, argv: list[str]) -> None:
    """Run `python -m module argv...` in this process with ABSENT absent: a None in
    sys.modules fails `import ray` and makes importlib.util.find_spec("ray") None, as on a
    machine without it."""
    for name in ABSENT:
        sys.modules[name] = None  # type: ignore[assignment]
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def summary(bench_json: Path, pytest_log: Path, dry_run: bool) -> dict:
    """`.ci/gpu`'s last line: the bench's figures, graphs and targets; the tests' counts."""
    report = json.loads(bench_json.read_text()) if bench_json.is_file() else None
    figures = (report or {}).get("figures") or {}
    out: dict = {
        "dry_run": dry_run,
        "bench": "ran" if report else "no result (see gpu.txt)",
        "copy_gbps": figures.get("copy_gbps"),
        "figures": {**figures.get("decode", {}), **figures.get("ttft", {})},
        "graphs": (report or {}).get("graphs"),
        "targets": {k: c["met"] for k, c in ((report or {}).get("targets") or {}).items()},
        "tests": test_counts(pytest_log.read_text() if pytest_log.is_file() else ""),
    }
    return out


def test_counts(log: str) -> dict[str, int]:
    """pytest's closing counts ('3 passed, 1 failed in 2s'; '12 tests collected'), from
    the last line that has them (an interrupted run prints them before its last lines)."""
    closing = re.compile(r"\d+ (passed|failed|errors?|skipped|tests? collected)\b")
    lines = [ln for ln in log.strip().splitlines() if closing.search(ln)]
    tail = lines[-1] if lines else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", tail)}
    if "tests" in counts or "test" in counts:
        return {"collected": counts.get("tests", counts.get("test", 0))}
    keys = ("passed", "failed", "errors", "error", "skipped")
    found = {k: counts[k] for k in keys if k in counts}
    if "error" in found:
        found["errors"] = found.pop("error")
    return found or {"unknown": 1}


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "stage":
        stage(Path(args[0] if args else ".dev"))
    elif command == "unpack":
        print(unpack(Path(args[0] if args else ".dev"), Path(args[1]) if len(args) > 1 else None))
    elif command == "plan":
        print(json.dumps(plan(Path(args[0] if args else ".dev"))))
    elif command == "bare" and len(args) >= 2 and args[0] == "-m":
        bare(args[1], args[2:])
    elif command == "summary" and len(args) >= 2:
        dry = "--dry-run" in args
        print(json.dumps(summary(Path(args[0]), Path(args[1]), dry)))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

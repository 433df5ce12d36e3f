"""`python -m benchmarks NAME [OPTIONS]`: run the bench NAME (`--help` after it for its own)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

# name -> what it measures; each is benchmarks/<name with _ for ->.py, imported only to run
BENCHES = {
    "kernels": "the multi-LoRA kernels against a per-sequence loop and the base projection",
    "fused": "a fused projection's LoRA (Phi-3, Phi-4) held split or fused",
    "engine": "the replica engine in-process: scenarios, ablations, a transformers baseline",
    "gpu": "the engine on one GPU at Llama-3.1-8B's shape: decode, HBM limit, TTFT, graphs",
    "overhead": "one workload in-process and over HTTP (2 replicas): the ratio",
    "prefix": "the demo cluster with the prefix cache on and off, 1 and 2 replicas",
    "tenants": "fair share on one replica: one tenant's flood against another's TTFT",
    "suite": "the demo cluster under every variant and scenario: JSON, table, plots",
    "many-adapters": "16 to 4,096 adapters registered at runtime: tok/s, TTFT, registration",
    "long-prefill": "a long prompt's prefill against transformers' sdpa: time and memory",
    "gated-delta": "Gated DeltaNet's layer core against transformers' torch, on a CPU",
    "quant-gemm": "quantized GEMMs against the dense matmul at Llama-3.1-8B layer shapes",
}


def usage() -> str:
    width = max(map(len, BENCHES))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, what in BENCHES.items())
    return (
        "usage: python -m benchmarks NAME [OPTIONS]   (python -m benchmarks NAME --help)\n\n"
        f"benches:\n{rows}\n\nTargets: benchmarks/targets.toml; results: benchmarks/results/."
    )


def bench(name: str) -> ModuleType:
    """The module of the bench `name`; SystemExit naming the benches for another name."""
    if name not in BENCHES:
        raise SystemExit(f"python -m benchmarks: no bench {name!r}\n\n{usage()}")
    return importlib.import_module(f"benchmarks.{name.replace('-', '_')}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    from benchmarks import harness

    return harness.main(bench(argv[0]), argv[1:])


if __name__ == "__main__":
    sys.exit(main())

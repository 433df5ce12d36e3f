"""The `lorafleet` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pydantic

from cluster import demo_assets
from cluster.engine_args import add_engine_arguments, engine_config_from_args
from replica.adapter_format import AdapterFormatError
from replica.engine import RequestError
from replica.model_config import ModelConfigError
from replica.weights import WeightLoadError

# Problems with what the user asked for: one line on stderr, exit code 2, no traceback.
USER_ERRORS = (
    AdapterFormatError,
    ModelConfigError,
    RequestError,
    WeightLoadError,
    pydantic.ValidationError,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-assets", help="Build the demo model and PEFT adapters.")
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--adapters", type=int, default=demo_assets.DemoSpec.num_adapters)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=demo_assets.ARCHS, default="llama")
    p.set_defaults(func=_demo_assets)

    p = sub.add_parser("generate", help="Offline generation through the engine.")
    p.add_argument("--model", required=True, help="Hugging Face model directory.")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="Register a PEFT adapter directory under NAME (repeatable).")  # fmt: skip
    p.add_argument("--prompt", action="append", required=True, help="Prompt text (repeatable).")
    p.add_argument("--adapter", action="append", default=[],
                   help="Adapter for the prompt at the same position ('base' for none); "
                        "one --adapter applies to every prompt.")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default).")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="Print one JSON object per prompt.")
    add_engine_arguments(p, skip={"model"})
    p.set_defaults(func=_generate)

    p = sub.add_parser("demo", help="Build demo assets and run a mixed multi-adapter batch.")
    p.add_argument("--out", default=None, help="Asset directory (default: the cache).")
    p.add_argument("--max-tokens", type=int, default=24)
    p.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="Benchmarks.").add_subparsers(dest="bench", required=True)
    from cluster import bench_engine, bench_kernels

    p = bench.add_parser("engine", help="The replica engine in-process: scenarios, ablations.")
    bench_engine.add_arguments(p)
    p.set_defaults(func=bench_engine.run)

    p = bench.add_parser("kernels", help="Multi-LoRA kernels vs a per-sequence loop.")
    bench_kernels.add_arguments(p)
    p.set_defaults(func=bench_kernels.run)

    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except USER_ERRORS as e:
        print(f"lorafleet: error: {e}", file=sys.stderr)
        return 2


def _demo_assets(args: argparse.Namespace) -> int:
    spec = demo_assets.DemoSpec(arch=args.arch, num_adapters=args.adapters, seed=args.seed)
    assets = demo_assets.build_demo_assets(args.out, spec)
    print(f"model:    {assets.model_dir}")
    for name, path in assets.adapters.items():
        print(f"adapter:  {name}={path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from cluster.offline import GenerateRequest, OfflineGenerator
    from replica.sampling import SamplingParams

    loras = dict(_parse_lora(s) for s in args.lora)
    adapters = _pair_adapters(args.prompt, args.adapter)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    config = engine_config_from_args(args, model=args.model, num_slots=max(2, len(loras) + 1))
    gen = OfflineGenerator(config, loras)
    results = gen.generate([GenerateRequest(p, a, sampling) for p, a in zip(args.prompt, adapters)])
    for r in results:
        if args.json:
            print(json.dumps(r.to_json()))
        else:
            print(f"[{r.adapter or 'base'}] {r.prompt}{r.text}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from cluster.offline import GenerateRequest, OfflineGenerator
    from replica.config import EngineConfig
    from replica.sampling import SamplingParams

    spec = demo_assets.DemoSpec()
    if args.out:
        assets = demo_assets.build_demo_assets(args.out, spec)
    else:
        assets = demo_assets.cached_demo_assets(spec)
    print(f"demo model {assets.model_dir} with {len(assets.adapters)} adapters")
    config = EngineConfig(model=str(assets.model_dir), num_slots=len(assets.adapters) + 1)
    gen = OfflineGenerator(config, {n: str(p) for n, p in assets.adapters.items()})
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompt = "The quick brown fox"
    names = [None, *assets.adapters]
    results = gen.generate([GenerateRequest(prompt, a, sampling) for a in names])
    print(f"one batch of {len(results)} requests, prompt {prompt!r}:")
    for r in results:
        print(f"  {r.adapter or 'base':>10} | {r.text!r}")
    return 0


def _parse_lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora {spec!r}: expected NAME=PATH")
    if not Path(path).is_dir():
        raise SystemExit(f"--lora {spec!r}: {path} is not a directory")
    return name, path


def _pair_adapters(prompts: list[str], adapters: list[str]) -> list[str | None]:
    if not adapters:
        adapters = ["base"]
    if len(adapters) == 1:
        adapters = adapters * len(prompts)
    if len(adapters) != len(prompts):
        raise SystemExit(
            f"{len(adapters)} --adapter values for {len(prompts)} prompts: give one, or one each"
        )
    return [None if a in ("base", "") else a for a in adapters]


if __name__ == "__main__":
    sys.exit(main())

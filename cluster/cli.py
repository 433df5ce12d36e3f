"""The `lorafleet` command line."""

# Only the standard library at module level: `lorafleet --help` answers at once, and each
# command imports what it needs (torch, Ray) when it runs.
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `lorafleet --help` stays fast
    from replica.model.spec import ModelSpec


class UsageError(ValueError):
    """A command line that cannot be run as given."""


# Problems with what the user asked for: one line on stderr, exit code 2, no traceback.
# (module, class): an error of one of them can only exist once its module is imported.
USER_ERRORS = (
    ("replica.model.peft_config", "AdapterFormatError"),
    ("replica.model.hf_config", "ModelConfigError"),
    ("replica.errors", "RequestError"),
    ("replica.model.weights", "WeightLoadError"),
    ("replica.executor.memory_plan", "MemoryPlanError"),
    ("pydantic", "ValidationError"),
    ("cluster.errors", "ServeConfigError"),
    ("cluster.demo.showcase", "ShowcaseError"),
    (__name__, "UsageError"),
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command(argv)).parse_args(argv)
    try:
        return args.func(args) or 0
    except Exception as e:
        if not _is_user_error(e):
            raise
        for line in _lines(e):
            print(f"lorafleet: error: {line}", file=sys.stderr)
        return 2


def _command(argv: list[str]) -> str:
    """The subcommand that `argv` names ('' for none: `lorafleet --help`)."""
    return next((a for a in argv if not a.startswith("-")), "")


def _is_user_error(error: Exception) -> bool:
    for module, name in USER_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(error, getattr(loaded, name)):
            return True
    return False


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand and flag (tests check the README's commands against it). `only`:
    the flags of that subcommand alone (the others are listed without theirs), so that a
    command imports only what its own flags need."""
    parser = argparse.ArgumentParser(prog="lorafleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if only is None or only == name:
            add(p)
    return parser


def _add_demo_assets(p: argparse.ArgumentParser) -> None:
    from cluster.demo import assets as demo_assets

    p.add_argument("--out", default=None,
                   help="Output directory. Required for the random-weight demo; with "
                        "--trained a copy of the committed trained demo goes there (default: "
                        "print where it is); with --retrain, where to train (default: "
                        "assets/demo-trained).")  # fmt: skip
    p.add_argument("--trained", action="store_true",
                   help="The trained demo (a model and one adapter per visible task), "
                        "committed under assets/demo-trained.")  # fmt: skip
    p.add_argument("--retrain", action="store_true",
                   help="With --trained: train it again, ~2 minutes on 2 CPU cores (needs "
                        "peft, a test dependency).")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="With --retrain: replace what --out (default: the committed "
                        "assets/demo-trained) already holds.")  # fmt: skip
    p.add_argument("--adapters", type=int, default=demo_assets.DemoSpec.num_adapters)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=demo_assets.ARCHS, default="llama")
    p.set_defaults(func=_demo_assets)


def _add_generate(p: argparse.ArgumentParser) -> None:
    from cluster.engine_args import add_engine_arguments

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


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="Words and '->' (default: a fixed example).")
    p.set_defaults(func=_demo)


def _add_up(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="Serve config file (default: configs/serve.yaml)."
    )
    p.add_argument("--model", default=None,
                   help="A Hugging Face model directory (default: the config's, "
                        "demo-trained).")  # fmt: skip
    p.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                   help="Register a PEFT adapter at start (repeatable); its parent directory "
                        "becomes an adapter root.")  # fmt: skip
    p.add_argument("--replicas", type=int, default=None, help="Fixed replica count.")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="Tensor-parallel ranks per replica (engine.tp_size): each replica "
                        "reserves N placement-group bundles (devices).")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Override an app setting (AppConfig), e.g. routing.policy=default, "
                        "engine.adapters.num_slots=4, store.demo_adapters=32 "
                        "(repeatable).")  # fmt: skip
    p.add_argument("--host", default=None, help="HTTP bind address (default: the config's).")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's).")
    p.add_argument("--address", default=None, help="Join this Ray cluster ('auto': the local one).")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a Ray started here.")
    p.add_argument("--no-demo-requests", action="store_true",
                   help="Skip the one-request-per-adapter showcase after start.")  # fmt: skip
    p.add_argument("--verbose", action="store_true",
                   help="Print the Ray actors' logs (requests, loads) and Ray's own messages "
                        "here too.")  # fmt: skip
    p.set_defaults(func=_up)


def _add_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="A Hugging Face model directory: its config.json is enough (no "
                        "weights are read, no GPU is used); the checkpoint's tensor names, "
                        "when there, tell how a Gemma 4 MoE holds its experts.")  # fmt: skip
    p.add_argument("--gpu-memory", required=True, metavar="SIZE",
                   help="Memory of one GPU, e.g. 80GiB, 141GB or bytes.")  # fmt: skip
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="Tensor-parallel ranks per replica (engine.tp_size).")  # fmt: skip
    p.add_argument("--dtype", default="auto",
                   help="The weights' dtype (engine.dtype; auto: bfloat16, as on CUDA).",
                   )  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="engine.max_model_len (default: the model's context).")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="engine.KEY=VALUE",
                   help="Any other engine setting, e.g. engine.gpu_memory_utilization=0.85, "
                        "engine.max_num_seqs=128 (repeatable).")  # fmt: skip
    p.add_argument("--json", action="store_true",
                   help="Print the plan as one JSON object, on the last line.")  # fmt: skip
    p.set_defaults(func=_plan)


def _add_deploy(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="Serve config file, e.g. configs/serve.yaml.")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto).")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--verbose", action="store_true", help="Print Ray's own messages too.")
    p.set_defaults(func=_deploy)


def _add_bench(p: argparse.ArgumentParser) -> None:
    bench = p.add_subparsers(dest="bench", required=True)
    from cluster.bench import http as bench_http

    p = bench.add_parser("http", help="HTTP load against a running server (OpenAI API).")
    bench_http.add_arguments(p)
    p.set_defaults(func=bench_http.run)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "demo-assets": ("Build the demo model and PEFT adapters.", _add_demo_assets),
    "generate": ("Offline generation through the engine.", _add_generate),
    "demo": ("The trained demo offline: every adapter in one batch.", _add_demo),
    "up": ("Serve over HTTP on a local (or running) Ray cluster.", _add_up),
    "plan": ("The memory plan of one GPU of a replica, from config.json alone.", _add_plan),
    "deploy": ("Deploy a Serve config to a running Ray cluster.", _add_deploy),
    "bench": ("Load generators (the experiments: python -m benchmarks).", _add_bench),
}


def _occupied(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _holds_trained_demo(path: Path) -> bool:
    from cluster.demo import training as demo_training

    try:
        demo_training.demo_assets(path)
    except FileNotFoundError:
        return False
    return True


def _lines(error: Exception) -> list[str]:
    """The error as lines: pydantic's field errors one line each, a ServeConfigError's
    problems one line each, any other message on one line."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(error, pydantic.ValidationError):
        return [f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()]
    errors = sys.modules.get("cluster.errors")
    if errors is not None and isinstance(error, errors.ServeConfigError):
        return [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    return [" ".join(str(error).split())]


def _demo_assets(args: argparse.Namespace) -> int:
    if args.retrain and not args.trained:
        print("lorafleet: error: --retrain needs --trained", file=sys.stderr)
        return 2
    if args.trained:
        from cluster.demo import letters
        from cluster.demo import training as demo_training

        if args.retrain:
            out = Path(args.out) if args.out else demo_training.ROOT
            if _occupied(out) and not args.force:
                raise UsageError(
                    f"{out} exists: --retrain replaces it only with --force (the committed "
                    f"trained demo is {demo_training.ROOT}); or give --out NEW_DIR"
                )
            assets = demo_training.train(out)
        elif args.out:
            out = Path(args.out)
            if _occupied(out) and not _holds_trained_demo(out):
                raise UsageError(f"{out} exists and holds something else: give a new --out")
            assets = demo_training.copy_demo_assets(out)
        else:
            assets = demo_training.demo_assets()
        for name, (what, *_) in demo_training.TASKS.items():
            print(f"task:     {name}: {what}")
        print(f"task:     {letters.NAME}: {letters.TASK}")
    elif args.out is None:
        print("lorafleet: error: demo-assets needs --out (or --trained)", file=sys.stderr)
        return 2
    else:
        from cluster.demo import assets as demo_assets

        spec = demo_assets.DemoSpec(arch=args.arch, num_adapters=args.adapters, seed=args.seed)
        try:
            assets = demo_assets.build_demo_assets(args.out, spec)
        except FileExistsError as e:
            raise UsageError(f"{e} (give a new --out)") from None
    print(f"model:    {assets.model_dir}")
    for name, path in assets.adapters.items():
        print(f"adapter:  {name}={path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from cluster.engine_args import engine_config_from_args
    from cluster.offline import GenerateRequest, OfflineGenerator
    from replica.wire import SamplingParams, applied_text

    loras = dict(_parse_lora(s) for s in args.lora)
    adapters = _pair_adapters(args.prompt, args.adapter)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    # a slot per adapter named (a small allocation) unless the flags size the slots
    sized = getattr(args, "engine_adapter_memory_bytes", None) is not None
    slots = {} if sized else {"num_slots": max(2, len(loras) + 1)}
    config = engine_config_from_args(args, model=args.model, adapters=slots)
    gen = OfflineGenerator(config, loras)
    for name, applied in gen.applied.items():  # on stderr: --json's stdout stays rows only
        print(f"adapter {name!r} applies {applied_text(applied)}", file=sys.stderr)
    try:
        requests = [GenerateRequest(p, a, sampling) for p, a in zip(args.prompt, adapters)]
        results = gen.generate(requests)
    finally:
        gen.close()
    for r in results:
        if args.json:
            print(json.dumps(r.to_json()))
        else:
            print(f"[{r.adapter or 'base'}] prompt: {r.prompt!r} | output: {r.text!r}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from cluster.demo import training as demo_training
    from cluster.offline import GenerateRequest, OfflineGenerator
    from replica.config import EngineConfig
    from replica.wire import SamplingParams

    assets = demo_training.demo_assets()
    prompt = args.prompt or demo_training.SHOWCASE_PROMPT
    # the adapters that answer such a prompt (not the letters one: it answers a question)
    adapters = {n: str(assets.adapters[n]) for n in demo_training.TASKS}
    config = EngineConfig(model=str(assets.model_dir), adapters={"num_slots": len(adapters) + 1})
    gen = OfflineGenerator(config, adapters)
    names = [None, *adapters]
    try:
        results = gen.generate(
            [GenerateRequest(prompt, a, SamplingParams(temperature=0)) for a in names]
        )
    finally:
        gen.close()
    print(f"one batch of {len(results)} requests, prompt {prompt!r}:")
    for r in results:
        print(f"  {r.adapter or 'base':>10} | {r.text.strip()!r}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from cluster import ports, preflight, serving

    loras = dict(_parse_lora(s) for s in args.lora) if args.lora is not None else None
    config = serving.apply_overrides(
        serving.load_config(args.config or serving.DEFAULT_CONFIG),
        model=args.model,
        loras=loras,
        replicas=args.replicas,
        tp=args.tp,
        port=args.port,
        host=args.host,
        settings=args.set,
    )
    if args.address and args.num_cpus is not None:
        raise UsageError("--num-cpus sizes a Ray started here: leave it out with --address")
    # what can be checked here is, before anything starts: the port (a Ray of our own starts
    # an HTTP proxy: the port must be free), the config, the model, the adapters
    http = config.get("http_options") or {}
    host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
    claimed = not args.address and isinstance(host, str) and isinstance(port, int)
    claimed = claimed and ports.claim_port(host, port)
    try:
        preflight.check_config(config, local=ports.is_local_address(args.address))
        _serve(config, args)
    finally:
        if claimed:
            ports.release_port(port)
    return 0


def _serve(config: dict, args: argparse.Namespace) -> None:
    """Start (or join) Ray, deploy, show, serve until stopped; then stop what it started."""
    from cluster import serving

    serving.quiet(args.verbose)
    stop = _Stop()
    submitted = False

    def on_submitted() -> None:
        nonlocal submitted
        submitted = True

    try:
        with stop.interrupting():
            # the replicas' logs stay in Ray's log files, so that the showcase can be read
            serving.connect(args.address, args.num_cpus, log_to_driver=args.verbose)
            stop.install()  # after ray.init, which installs a SIGTERM handler of its own
            serving.deploy(config, join=bool(args.address), fail_fast=True, submitted=on_submitted)
            _announce(config, args)
            while True:
                time.sleep(3600)
    finally:
        stop.stopping()
        try:
            serving.stop(config, own_ray=not args.address, submitted=submitted, forced=stop.forced)
        finally:
            stop.restore()


class _Stop:
    """Ctrl-C and SIGTERM for `lorafleet up`. The first one interrupts what `up` is doing
    (starting, or serving) and it stops cleanly; one more during that stop forces it
    (requests still in flight are cut at once, with an error); a third ends the process
    there and then. None prints a traceback."""

    def __init__(self) -> None:
        self.signals = 0
        self._stopping = False
        self._before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def install(self) -> None:
        for sig in self._before:
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        """The handlers from before `up` (a test calling main() keeps its own)."""
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def interrupting(self) -> contextlib.suppress:
        """A block that the interrupt beginning a stop ends quietly."""
        self.install()
        return contextlib.suppress(KeyboardInterrupt)

    def stopping(self) -> None:
        self._stopping = True

    def forced(self) -> bool:
        return self.signals > 0

    def _handle(self, signum: int, frame: object) -> None:
        # os.write, not print: a handler may run in the middle of a print of the main thread
        if not self._stopping:
            self._stopping = True
            os.write(2, b"lorafleet: stopping (Ctrl-C again to stop at once)\n")
            raise KeyboardInterrupt
        self.signals += 1
        if self.signals == 1:
            os.write(2, b"lorafleet: stopping at once: requests in flight are cut\n")
        else:
            os._exit(128 + signum)


def _announce(config: dict, args: argparse.Namespace) -> None:
    """Where it serves, the showcase (one request per model, side by side), how to try it."""
    from cluster import serving
    from cluster.config import DEMO_TRAINED
    from cluster.demo import showcase

    http = config.get("http_options", {})
    host = http.get("host", "127.0.0.1")
    prefix = config["applications"][0].get("route_prefix", "/").rstrip("/")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"
    url += prefix
    print(f"lorafleet is serving at {url}  (Ctrl-C stops it)")
    if not args.verbose:
        print(f"logs: {serving.log_dir()}  (--verbose prints them here)")
    prompt, notes, tool_model = showcase.PROMPT, {}, None
    if config["applications"][0]["args"].get("engine", {}).get("model") == DEMO_TRAINED:
        from cluster.demo import letters
        from cluster.demo import training as demo_training

        prompt = demo_training.SHOWCASE_PROMPT
        notes = {"demo-base": demo_training.BASE_TASK[0]}
        notes |= {name: what for name, (what, *_) in demo_training.TASKS.items()}
        tool_model = letters.NAME
    key = serving.client_api_key(config)
    if key is None and (config["applications"][0]["args"].get("ingress") or {}).get("tenants"):
        # every request needs a tenant's key, and a key is never in the config (digests)
        print("tenants are configured and no admin key: no showcase; call it with a "
              "tenant's key (docs/serving/tenants.md)", flush=True)  # fmt: skip
        return
    if args.no_demo_requests:
        names = showcase.model_names(url, key)
    else:
        leave_out = [tool_model] if tool_model else []
        names = showcase.show(url, prompt, notes=notes, api_key=key, leave_out=leave_out)
        if tool_model in showcase.model_names(url, key):
            _tool_round_trip(url, tool_model, key)
    key_env, exported = serving.key_for_commands(config)
    print(showcase.try_it(url, names[-1], prompt, key_env, exported), flush=True)


def _tool_round_trip(url: str, model: str, key: str | None) -> None:
    """The trained demo's letters adapter asked a question it calls count_letters for."""
    from cluster.demo import letters, showcase

    tool, function = letters.COUNT_LETTERS_TOOL, letters.count_letters
    showcase.tool_round_trip(url, model, letters.SHOWCASE_QUESTION, tool, function, api_key=key)


def _plan(args: argparse.Namespace) -> int:
    """What a replica's GPU holds (executor/memory_plan.py), computed on this machine."""
    import torch
    import yaml

    from cluster.config import upgrade_setting
    from cluster.serving import set_path
    from replica.config import EngineConfig
    from replica.device import resolve_dtype
    from replica.executor.memory_plan import gib, plan_memory, weights_note
    from replica.model.spec import load_model_spec
    from replica.model.weights import checkpoint_bytes

    values = {"model": args.model, "device": "cuda", "dtype": args.dtype, "tp_size": args.tp,
              "max_model_len": args.max_model_len}  # fmt: skip
    for setting in args.set:
        key, sep, value = setting.partition("=")
        if not sep or not key.startswith("engine.") or key == "engine.model":
            raise UsageError(f"--set {setting!r}: expected engine.KEY=VALUE (an engine setting)")
        value = yaml.safe_load(value)
        set_path(values, upgrade_setting(key, value).removeprefix("engine."), value, setting)
    config = EngineConfig(**values)
    spec = load_model_spec(args.model)
    dtype = resolve_dtype(config.dtype, torch.device("cuda"))
    plan = plan_memory(spec, config, dtype, _size_bytes(args.gpu_memory))
    c = config
    stored = checkpoint_bytes(args.model)
    note = weights_note(spec)
    lines = {
        "model": f"{args.model}: {spec.arch}, {spec.num_parameters() / 1e9:.2f}B parameters, "
        f"{str(dtype).removeprefix('torch.')}, tp_size {c.tp_size}",
        "budget": f"{gib(plan.budget_bytes)} per GPU: gpu_memory_utilization "
        f"{c.gpu_memory_utilization:g} of {gib(plan.device_bytes)}, less "
        f"{gib(plan.in_use_bytes)} for the CUDA context",
        "weights": f"{gib(plan.weights_bytes_per_gpu)} per GPU"
        + ("" if spec.quant is None else f", {_packed_what(spec)} packed ({spec.quant.method})")
        + ("" if stored is None else f" (the checkpoint's index: {gib(stored)} in all)")
        + ("" if note is None else f"; {note}"),
        "activations": f"{gib(plan.activation_bytes)}, estimated for the largest step "
        f"({min(c.max_num_batched_tokens, plan.max_model_len):,} tokens at context "
        f"{plan.max_model_len:,})"
        + ("; a single-rank replica profiles it at start" if c.tp_size == 1 else ""),
        "CUDA graphs": f"{gib(plan.graph_bytes)}, estimated (logits buffer, inputs and pool)"
        if plan.graph_bytes
        else "none: tensor-parallel replicas and cuda_graphs=false run eagerly",
        "adapters": f"{gib(plan.adapter_memory_bytes)}: {plan.num_slots - 1} of rank "
        f"{c.max_lora_rank} ({plan.adapter_rows:,} rank rows per projection group), up to "
        f"{plan.max_loras_per_batch} per batch",
        "KV cache": f"{gib(plan.kv_cache_bytes)}: {plan.kv_cache_tokens:,} tokens in "
        f"{plan.num_blocks:,} blocks of {c.block_size}; "
        f"{plan.max_concurrency_at_max_model_len:g} sequences of max_model_len "
        f"{plan.max_model_len:,} at once",
    }
    for name, line in lines.items():
        print(f"{name:<12} {line}")
    if args.json:
        print(json.dumps(plan.to_json() | {"checkpoint_bytes": stored, "weights_note": note}))
    return 0


SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def _packed_what(spec: ModelSpec) -> str:
    """What a quantized checkpoint holds packed: gpt-oss ships only its experts so."""
    return "experts" if spec.quant is not None and spec.quant.method == "mxfp4" else "projections"


def _size_bytes(text: str) -> int:
    """Bytes of a size like 80GiB, 141GB, 79.6GiB or 85899345920."""
    number = text.strip().rstrip("BbIiKkMmGgTt ")
    unit = text.strip()[len(number) :].strip().lower()
    try:
        size = float(number) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise UsageError(f"--gpu-memory {text!r}: expected a size such as 80GiB or 141GB") from None
    if size <= 0:
        raise UsageError(f"--gpu-memory {text!r}: must be positive")
    return int(size)


def _deploy(args: argparse.Namespace) -> int:
    from cluster import ports, preflight, serving

    config = serving.load_config(args.config)
    preflight.check_config(config, local=ports.is_local_address(args.address))
    serving.quiet(args.verbose)
    serving.connect(args.address)
    serving.deploy(config, args.timeout_s)
    names = ", ".join(a["name"] for a in config["applications"])
    print(f"deployed {names} from {args.config}")
    return 0


def _parse_lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise UsageError(f"--lora {spec!r}: expected NAME=PATH")
    if not Path(path).is_dir():
        raise UsageError(f"--lora {spec!r}: {path} is not a directory")
    return name, path


def _pair_adapters(prompts: list[str], adapters: list[str]) -> list[str | None]:
    if not adapters:
        adapters = ["base"]
    if len(adapters) == 1:
        adapters = adapters * len(prompts)
    if len(adapters) != len(prompts):
        raise UsageError(
            f"{len(adapters)} --adapter values for {len(prompts)} prompts: give one, or one each"
        )
    return [None if a in ("base", "") else a for a in adapters]


if __name__ == "__main__":
    sys.exit(main())

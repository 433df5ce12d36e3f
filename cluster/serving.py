"""`lorafleet up` and `lorafleet deploy`: Serve config files onto a Ray cluster.

A config is an ordinary Ray Serve config (configs/*.yaml). Deploying goes
through Serve's controller exactly as `serve run CONFIG` / `serve deploy CONFIG`
do, so a second deploy of an edited file (say, its autoscaling_config) is applied
in place: unchanged replicas keep running and keep their requests.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml

from cluster.config import DEMOS, upgrade_args, upgrade_setting
from cluster.errors import ServeConfigError
from cluster.ports import claim_port, proxy_here, release_port

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"
REPLICA_DEPLOYMENT = "LoRAReplica"
IMPORT_PATH = "cluster.app:build_app"  # the applications whose args are an AppConfig
# `lorafleet up` stops within STOP_GRACE_S + Ray's own shutdown: requests in flight get
# that long to finish, then those still running are cut with an error.
STOP_GRACE_S = 5.0


def load_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ServeConfigError(f"Serve config {path} does not exist")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ServeConfigError(f"{path}: invalid YAML ({e})") from None
    if not isinstance(config, dict) or not config.get("applications"):
        raise ServeConfigError(f"{path}: not a Serve config (no 'applications' list)")
    for app in config["applications"]:
        if isinstance(app, dict) and app.get("import_path") == IMPORT_PATH:
            app["args"] = _upgraded(app.get("args") or {}, f"{path}: {app.get('name')}")
    return config


def _upgraded(args: dict[str, Any], where: str) -> dict[str, Any]:
    """`args` in the nested shape (flat keys of the previous release moved, each logged)."""
    if not isinstance(args, dict):  # not an AppConfig at all: preflight names the problem
        return args
    try:
        return upgrade_args(args)
    except ValueError as e:
        raise ServeConfigError(f"{where}: {e}") from None


# Settings that size one thing two ways (AppConfig accepts one): --set of one drops the
# other from the file.
SIZED_BY_EITHER = {
    "engine.adapters.num_slots": "engine.adapters.adapter_memory_bytes",
    "engine.adapters.adapter_memory_bytes": "engine.adapters.num_slots",
}


def apply_overrides(
    config: dict[str, Any],
    *,
    model: str | None = None,
    loras: dict[str, str] | None = None,
    replicas: int | None = None,
    tp: int | None = None,
    port: int | None = None,
    host: str | None = None,
    settings: list[str] = (),
) -> dict[str, Any]:
    """The config with the command line's values in place of the file's (first app).
    `settings` are KEY=VALUE strings on the app's args (AppConfig), dotted keys for nested
    fields, YAML values: "routing.policy=default", "engine.adapters.num_slots=4",
    "store.demo_adapters=32". The previous release's flat keys ("routing=default",
    "engine.num_slots=4") are read too, each with a deprecation line naming its path now."""
    config = copy.deepcopy(config)
    app = config["applications"][0]
    args = app["args"] = _upgraded(app.get("args") or {}, "the config")
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key:
            raise ServeConfigError(f"--set {setting!r}: expected KEY=VALUE")
        value = yaml.safe_load(text)
        key = upgrade_setting(key, value)
        node = set_path(args, key, value, setting)
        if key in SIZED_BY_EITHER:  # the file's other way of sizing them gives way
            node.pop(SIZED_BY_EITHER[key].rpartition(".")[2], None)
    if model is not None:
        args.setdefault("engine", {})["model"] = str(Path(model).resolve())
        if loras is None and (args.get("store") or {}).get("adapters") in DEMOS:
            args["store"]["adapters"] = {}  # demo adapters only fit the demo model
    if loras is not None:
        store = args["store"] = args.get("store") or {}
        store["adapters"] = {n: str(Path(p).resolve()) for n, p in loras.items()}
        roots = {str(Path(p).resolve().parent) for p in loras.values()}
        store["adapter_roots"] = sorted(set(store.get("adapter_roots") or []) | roots)
    if replicas is not None:
        deployment = _deployment(app, REPLICA_DEPLOYMENT)
        deployment.pop("autoscaling_config", None)
        deployment["num_replicas"] = replicas
    if tp is not None:
        _set_tp_size(args, _deployment(app, REPLICA_DEPLOYMENT), tp)
    http = config.setdefault("http_options", {})
    if port is not None:
        http["port"] = port
    if host is not None:
        http["host"] = host
    return config


def set_path(root: dict[str, Any], key: str, value: Any, setting: str) -> dict[str, Any]:
    """Sets dotted path `key` ("engine.adapters.num_slots") of `root` to `value`, making
    the sections on the way; returns the innermost. `setting`: what the user wrote."""
    *parents, leaf = key.split(".")
    node = root
    for part in parents:
        node[part] = node.get(part) or {}
        node = node[part]
        if not isinstance(node, dict):
            raise ServeConfigError(f"--set {setting!r}: {part} is not a section")
    node[leaf] = value
    return node


def deploy(
    config: dict[str, Any],
    timeout_s: float = 300.0,
    join: bool = False,
    fail_fast: bool = False,
    submitted: Callable[[], None] | None = None,
) -> None:
    """Deploy to the Ray cluster this process is connected to; wait until every app runs.

    Without `join` the config is the cluster's whole declarative Serve config, as with
    `serve deploy` (applications it does not list, deployed from a config earlier, go).
    With `join` (`lorafleet up --address`) the config's applications are added beside
    those already running: one whose name or route prefix is taken is refused, as is an
    HTTP address other than that of a Serve instance already running there (Serve would
    keep its own). Where no Serve runs yet, its HTTP port must be free (`claim_port`).
    Every refusal comes before anything is deployed; `submitted` is called once the
    applications are handed to Serve. A deployment that fails is a ServeConfigError
    naming its root cause; `fail_fast`: at its first failed start, without waiting for
    Serve's retries."""
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    running = running_http_address()
    wanted = (schema.http_options.host, schema.http_options.port)
    if running is not None and running != wanted:
        raise ServeConfigError(
            f"Serve already runs on this Ray cluster with HTTP on {running[0]}:{running[1]}, "
            f"not {wanted[0]}:{wanted[1]}: use --port {running[1]} (and --host {running[0]}), "
            "or stop that Serve instance first (serve shutdown)"
        )
    claimed = running is None and proxy_here(str(schema.proxy_location))
    claimed = claimed and claim_port(*wanted)
    try:
        if join:
            others = _running_app_configs()
            _check_free(schema, others)
            apps = [
                *others.values(),
                *(a.model_dump(exclude_unset=True) for a in schema.applications),
            ]
            schema = ServeDeploySchema.model_validate({**config, "applications": apps})
        client = serve_api.serve_start(
            http_options=schema.http_options.model_dump(),
            proxy_location=schema.proxy_location,
            grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        )
        client.deploy_apps(schema, _blocking=False)
        if submitted is not None:
            submitted()
        wait_until_running([a["name"] for a in config["applications"]], timeout_s, fail_fast)
    finally:
        if claimed:  # Serve's proxy holds the port now
            release_port(wanted[1])


def _running_app_configs() -> dict[str, dict[str, Any]]:
    """name -> deployed config of the applications a config deployed on this cluster
    (their declarative config is what a new deploy must repeat to keep them)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return {}
    apps = client.get_serve_details().get("applications", {})
    configs = {}
    for name, details in apps.items():
        deployed = details.get("deployed_app_config")
        if deployed is None:
            raise ServeConfigError(
                f"application {name!r} on this cluster was started by serve.run, not from a "
                "config: lorafleet cannot deploy beside it without removing it"
            )
        configs[name] = deployed
    return configs


def _check_free(schema: Any, others: dict[str, dict[str, Any]]) -> None:
    taken = {cfg.get("route_prefix", "/"): name for name, cfg in others.items()}
    for app in schema.applications:
        if app.name in others:
            raise ServeConfigError(
                f"an application named {app.name!r} already runs on this cluster: "
                "`lorafleet deploy` updates it; `up` would replace it and remove it on exit"
            )
        if app.route_prefix in taken:
            raise ServeConfigError(
                f"route prefix {app.route_prefix!r} is taken by application "
                f"{taken[app.route_prefix]!r} on this cluster: give yours another"
            )


def client_api_key(config: dict[str, Any]) -> str | None:
    """The API key the first application's Ingress requires, as it resolves it: the
    config's api_key, else its api_key_env variable from the app's runtime_env, else from
    this process's environment (a Ray started here passes it on to the Ingress)."""
    app = config["applications"][0]
    ingress = (app.get("args") or {}).get("ingress") or {}
    if ingress.get("api_key"):
        return str(ingress["api_key"])
    env = api_key_env(config)
    runtime = (app.get("runtime_env") or {}).get("env_vars") or {}
    return runtime.get(env) or os.environ.get(env) or None


def key_for_commands(config: dict[str, Any]) -> tuple[str | None, bool]:
    """The variable commands printed for users read the API key from (None: no key is
    required), and whether this process's environment holds the key there: not when the
    key comes from the config's api_key or its runtime_env."""
    key = client_api_key(config)
    if key is None:
        return None, True
    env = api_key_env(config)
    return env, os.environ.get(env) == key


def api_key_env(config: dict[str, Any]) -> str:
    """The environment variable the first application's Ingress reads its key from."""
    ingress = (config["applications"][0].get("args") or {}).get("ingress") or {}
    return ingress.get("api_key_env") or "LORAFLEET_API_KEY"


def running_http_address() -> tuple[str, int] | None:
    """(host, port) of the Serve instance running on the connected cluster, if any."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    http = client.http_config
    return http.host, http.port


def remove(config: dict[str, Any]) -> None:
    """Delete the config's applications, and nothing else of the Serve instance (a joined
    cluster may serve other applications)."""
    from ray import serve

    for app in config["applications"]:
        serve.delete(app["name"])


def wait_until_running(app_names: list[str], timeout_s: float, fail_fast: bool = False) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {n: apps[n].status if n in apps else "NOT_STARTED" for n in app_names}
        for name in app_names:
            cause = _failure(name, apps[name], fail_fast) if name in apps else None
            if cause is not None:
                raise ServeConfigError(f"{cause} (Ray's logs: {log_dir()})")
        if all(s == "RUNNING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not running after {timeout_s:.0f}s: {states}")
        time.sleep(0.5)


def _failure(name: str, app: Any, early: bool) -> str | None:
    """Why application `name` failed, in one line (None while it has not): its deployment
    that failed and the exception that ended it, read from Serve's status. `early`: a
    replica that failed to start counts, though Serve would still retry it."""
    for deployment, status in app.deployments.items():
        message = status.message or ""
        if status.status == "DEPLOY_FAILED" or (early and "failed to start" in message):
            return f"application {name!r}: {deployment} failed to start: {root_cause(message)}"
    if app.status == "DEPLOY_FAILED":
        return f"application {name!r} failed: {root_cause(app.message or 'no reason given')}"
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit)): ?(.*)")


def root_cause(message: str) -> str:
    """The exception at the end of a traceback in a Serve status message, as one line
    ("ModelConfigError: ...: unsupported architecture ..."); the message's first line when
    it holds no traceback."""
    lines = [line.rstrip() for line in _ANSI.sub("", message).splitlines() if line.strip()]
    last = None
    for i, line in enumerate(lines):
        if _EXCEPTION_LINE.match(line):
            last = i
    if last is None:
        return " ".join(lines[0].split()) if lines else "no reason given"
    name, text = _EXCEPTION_LINE.match(lines[last]).groups()
    more = [line for line in lines[last + 1 :] if "errors.pydantic.dev" not in line]
    text = " ".join(" ".join([text, *more]).split())
    return f"{name}: {text}" if text else name


def connect(address: str | None, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address` ('auto': the local one), or start a fresh local Ray
    (never a leftover one that RAY_ADDRESS or Ray's last-cluster file points at).
    log_to_driver=False keeps the actors' logs in Ray's log files only."""
    if address and num_cpus is not None:  # refused even when this process has a Ray
        raise ServeConfigError("--num-cpus sizes a Ray started here: leave it out with --address")
    if ray.is_initialized():
        return
    if address:
        try:
            ray.init(
                address=address,
                namespace="serve",
                log_to_driver=log_to_driver,
                logging_level=_ray_logging_level(),
            )
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ServeConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from None
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace="serve",
            include_dashboard=False,
            log_to_driver=log_to_driver,
            logging_level=_ray_logging_level(),
        )


def _set_tp_size(args: dict[str, Any], deployment: dict[str, Any], tp: int) -> None:
    """engine.tp_size = tp, and one placement-group bundle per rank where the file sizes the
    replica itself (otherwise build_app derives the bundles from tp_size): each bundle as
    large as the file's first bundle, or as its ray_actor_options."""
    args.setdefault("engine", {})["tp_size"] = tp
    bundles, actor = deployment.get("placement_group_bundles"), deployment.get("ray_actor_options")
    if bundles:
        bundle = dict(bundles[0])
    elif actor:
        bundle = {"CPU": actor.get("num_cpus", 1)}
        if actor.get("num_gpus"):
            bundle["GPU"] = actor["num_gpus"]
    else:
        return
    if tp == 1:
        deployment.pop("placement_group_bundles", None)
        deployment.pop("placement_group_strategy", None)
    else:
        deployment["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
        deployment.setdefault("placement_group_strategy", "STRICT_PACK")


def _deployment(app: dict[str, Any], name: str) -> dict[str, Any]:
    deployments = app.setdefault("deployments", [])
    for d in deployments:
        if d.get("name") == name:
            return d
    deployments.append({"name": name})
    return deployments[-1]


def log_dir() -> str:
    """Where this node's Ray processes (Serve's replicas among them) write their logs."""
    node = getattr(ray._private.worker, "_global_node", None)  # no public accessor
    return node.get_logs_dir_path() if node is not None else "/tmp/ray/session_latest/logs"


# -- a clean stop -----------------------------------------------------------------------------


def quiet(verbose: bool) -> None:
    """Keep Ray's and Serve's own INFO lines (a Ray started, Serve started, an application
    deleted) out of a command's output unless `verbose`; warnings and errors still show."""
    if verbose:
        return
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray turns token authentication on for a cluster it starts (as it should) and warns
    # that it did, at every start
    logging.getLogger(_TOKEN_SETUP).setLevel(logging.ERROR)


_TOKEN_SETUP = "ray._private.authentication.authentication_token_setup"


def _ray_logging_level() -> int:
    """ray.init sets the "ray" logger's level: keep the one quiet() set."""
    return max(logging.getLogger("ray").level, logging.INFO)


def stop(
    config: dict[str, Any],
    own_ray: bool,
    submitted: bool = True,
    grace_s: float = STOP_GRACE_S,
    forced: Callable[[], bool] = lambda: False,
) -> None:
    """Stop what `lorafleet up` started. Its applications are deleted: Serve refuses new
    requests and lets those in flight finish, for up to `grace_s` (less once `forced()`
    is true: a second Ctrl-C). With `own_ray` (the Ray this process started) the replicas
    of requests still running are then killed, so that the ingress ends each with an error
    (a 503, or an error event in a stream), and Ray shuts down with everything on it.
    Joined to a cluster, only this config's applications are deleted (Serve finishes
    that on its own)."""
    from ray import serve

    names = [a["name"] for a in config["applications"]]
    if submitted and ray.is_initialized():
        deadline = time.monotonic() + grace_s
        try:
            for name in names:
                serve.delete(name, _blocking=False)
            while not forced() and time.monotonic() < deadline and _present(names):
                time.sleep(0.2)
            if own_ray and _present(names):
                _cut(names)
        except Exception as e:  # a controller already gone: nothing left to wait for
            logging.getLogger(__name__).debug("stop: %s", e)
    if own_ray and ray.is_initialized():
        ray.shutdown()


def _present(names: list[str]) -> bool:
    from ray import serve

    apps = serve.status().applications
    return any(name in apps for name in names)


def _cut(names: list[str]) -> None:
    """Kill the LoRAReplicas of these applications; give the ingress a moment to answer
    the requests they were running with an error."""
    prefixes = tuple(f"SERVE_REPLICA::{name}#{REPLICA_DEPLOYMENT}#" for name in names)
    killed = 0
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefixes):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
                killed += 1
            except ValueError:  # gone meanwhile
                pass
    if killed:
        time.sleep(1.0)

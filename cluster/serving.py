"""`lorafleet up` and `lorafleet deploy`: Serve config files onto a Ray cluster.

A config is an ordinary Ray Serve config (configs/*.yaml). Deploying goes
through Serve's controller exactly as `serve run CONFIG` / `serve deploy CONFIG`
do, so a second deploy of an edited file (say, its autoscaling_config) is applied
in place: unchanged replicas keep running and keep their requests.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import ray
import yaml

from cluster.config import DEMOS

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"
REPLICA_DEPLOYMENT = "LoRAReplica"


class ServeConfigError(ValueError):
    """A Serve config file that cannot be read or deployed."""


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
    return config


# Settings that size one thing two ways (AppConfig accepts one): --set of one drops the
# other from the file.
SIZED_BY_EITHER = {
    "engine.num_slots": "engine.adapter_memory_bytes",
    "engine.adapter_memory_bytes": "engine.num_slots",
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
    fields, YAML values: "routing=default", "engine.num_slots=4", "demo_adapters=32"."""
    config = copy.deepcopy(config)
    app = config["applications"][0]
    args = app.setdefault("args", {})
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise ServeConfigError(f"--set {setting!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = args
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ServeConfigError(f"--set {setting!r}: {part} is not a section")
        node[leaf] = yaml.safe_load(value)
        if key in SIZED_BY_EITHER:  # the file's other way of sizing them gives way
            node.pop(SIZED_BY_EITHER[key].rpartition(".")[2], None)
    if model is not None:
        args.setdefault("engine", {})["model"] = str(Path(model).resolve())
        if loras is None and args.get("adapters") in DEMOS:
            args["adapters"] = {}  # demo adapters only fit the demo model
    if loras is not None:
        args["adapters"] = {n: str(Path(p).resolve()) for n, p in loras.items()}
        roots = {str(Path(p).resolve().parent) for p in loras.values()}
        args["adapter_roots"] = sorted(set(args.get("adapter_roots") or []) | roots)
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


def deploy(config: dict[str, Any], timeout_s: float = 300.0, join: bool = False) -> None:
    """Deploy to the Ray cluster this process is connected to; wait until every app runs.

    Without `join` the config is the cluster's whole declarative Serve config, as with
    `serve deploy` (applications it does not list, deployed from a config earlier, go).
    With `join` (`lorafleet up --address`) the config's applications are added beside
    those already running: one whose name or route prefix is taken is refused, as is an
    HTTP address other than that of a Serve instance already running there (Serve would
    keep its own). Every refusal comes before anything is deployed."""
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
    if join:
        others = _running_app_configs()
        _check_free(schema, others)
        apps = [*others.values(), *(a.model_dump(exclude_unset=True) for a in schema.applications)]
        schema = ServeDeploySchema.model_validate({**config, "applications": apps})
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
    )
    client.deploy_apps(schema, _blocking=False)
    wait_until_running([a["name"] for a in config["applications"]], timeout_s)


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
    args = app.get("args") or {}
    if args.get("api_key"):
        return str(args["api_key"])
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
    args = config["applications"][0].get("args") or {}
    return args.get("api_key_env") or "LORAFLEET_API_KEY"


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


def wait_until_running(app_names: list[str], timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        states = {n: apps[n].status if n in apps else "NOT_STARTED" for n in app_names}
        failed = {n: apps[n].message for n, s in states.items() if s == "DEPLOY_FAILED"}
        if failed:
            raise ServeConfigError(f"deployment failed: {failed}")
        if all(s == "RUNNING" for s in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not running after {timeout_s:.0f}s: {states}")
        time.sleep(0.5)


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
            ray.init(address=address, namespace="serve", log_to_driver=log_to_driver)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ServeConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from None
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            namespace="serve",
            include_dashboard=False,
            log_to_driver=log_to_driver,
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

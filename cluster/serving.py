"""`lorafleet up` and `lorafleet deploy`: Serve config files onto a Ray cluster.

A config is an ordinary Ray Serve config (configs/*.yaml). Deploying goes
through Serve's controller exactly as `serve run CONFIG` / `serve deploy CONFIG`
do, so a second deploy of an edited file (say, its autoscaling_config) is applied
in place: unchanged replicas keep running and keep their requests.
"""

from __future__ import annotations

import copy
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


def deploy(config: dict[str, Any], timeout_s: float = 300.0) -> None:
    """Deploy to the Ray cluster this process is connected to; wait until every app runs."""
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
    )
    client.deploy_apps(schema, _blocking=False)
    wait_until_running([a.name for a in schema.applications], timeout_s)


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
    """Join the cluster at `address` ('auto': the local one), or start a local Ray.
    log_to_driver=False keeps the actors' logs in Ray's log files only."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace="serve", log_to_driver=log_to_driver)
    else:
        ray.init(
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

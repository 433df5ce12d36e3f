"""Serve config files, the command line's overrides, and the application config."""

from __future__ import annotations

import pydantic
import pytest

from cluster import ports, serving
from cluster.app import build_app
from cluster.config import AppConfig


def test_default_config_is_valid_for_serve_and_for_the_app():
    from ray.serve.schema import ServeDeploySchema

    config = serving.load_config(serving.DEFAULT_CONFIG)
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    assert app["import_path"] == "cluster.app:build_app"
    AppConfig.model_validate(app["args"])
    replica = next(d for d in app["deployments"] if d["name"] == serving.REPLICA_DEPLOYMENT)
    assert "autoscaling_config" in replica


@pytest.mark.parametrize("name", ["gpu-1.yaml", "gpu-autoscale.yaml", "gpu-tp2.yaml"])
def test_gpu_examples_are_valid(name):
    from ray.serve.schema import ServeDeploySchema

    config = serving.load_config(serving.DEFAULT_CONFIG.parent / name)
    ServeDeploySchema.model_validate(config)
    app = AppConfig.model_validate(config["applications"][0]["args"])
    replica = _replica_deployment(config)
    assert len(replica.get("placement_group_bundles", [{}])) == app.engine.tp_size


def _replica_deployment(config: dict) -> dict:
    deployments = config["applications"][0]["deployments"]
    return next(d for d in deployments if d["name"] == serving.REPLICA_DEPLOYMENT)


def test_tp_override_reserves_one_bundle_per_rank():
    from ray.serve.schema import ServeDeploySchema

    cpu = serving.apply_overrides(serving.load_config(serving.DEFAULT_CONFIG), tp=2)
    assert cpu["applications"][0]["args"]["engine"]["tp_size"] == 2
    assert _replica_deployment(cpu)["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    gpu = serving.load_config(serving.DEFAULT_CONFIG.parent / "gpu-1.yaml")
    gpu = serving.apply_overrides(gpu, tp=4)
    assert _replica_deployment(gpu)["placement_group_bundles"] == [{"CPU": 4, "GPU": 1}] * 4
    one = serving.load_config(serving.DEFAULT_CONFIG.parent / "gpu-tp2.yaml")
    one = serving.apply_overrides(one, tp=1)
    assert "placement_group_bundles" not in _replica_deployment(one)
    for config in (cpu, gpu, one):
        ServeDeploySchema.model_validate(config)
        AppConfig.model_validate(config["applications"][0]["args"])


def test_overrides_replace_the_files_values(tmp_path):
    lora = tmp_path / "adapters" / "support"
    lora.mkdir(parents=True)
    config = serving.apply_overrides(
        serving.load_config(serving.DEFAULT_CONFIG),
        model=str(tmp_path / "model"),
        loras={"support": str(lora)},
        replicas=3,
        port=9123,
        host="127.0.0.2",
        settings=[
            "routing.policy=default",
            "engine.adapters.num_slots=5",
            "routing.load_bound_epsilon=0.5",
        ],
    )
    args = config["applications"][0]["args"]
    assert args["engine"]["model"] == str(tmp_path / "model")
    assert args["engine"]["adapters"]["num_slots"] == 5
    assert "adapter_memory_bytes" not in args["engine"]["adapters"]  # the file's sizing gives way
    assert args["store"]["adapters"] == {"support": str(lora)}
    assert str(tmp_path / "adapters") in args["store"]["adapter_roots"]
    assert args["routing"] == {"policy": "default", "load_bound_epsilon": 0.5}
    replica = config["applications"][0]["deployments"][0]
    assert replica["num_replicas"] == 3 and "autoscaling_config" not in replica
    assert config["http_options"] == {"host": "127.0.0.2", "port": 9123}
    AppConfig.model_validate(args)


def test_own_model_drops_the_demo_adapters(tmp_path):
    config = serving.apply_overrides(serving.load_config(serving.DEFAULT_CONFIG), model="m")
    assert config["applications"][0]["args"]["store"]["adapters"] == {}


@pytest.mark.parametrize("setting", ["novalue", "=3", "engine.model.x=1"])
def test_bad_settings_are_refused(setting):
    with pytest.raises(serving.ServeConfigError):
        serving.apply_overrides(serving.load_config(serving.DEFAULT_CONFIG), settings=[setting])


def test_bad_config_files_are_refused(tmp_path):
    with pytest.raises(serving.ServeConfigError, match="does not exist"):
        serving.load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("applications: [\n")
    with pytest.raises(serving.ServeConfigError, match="invalid YAML"):
        serving.load_config(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("http_options: {}\n")
    with pytest.raises(serving.ServeConfigError, match="applications"):
        serving.load_config(tmp_path / "empty.yaml")


def test_app_config_refuses_unknown_and_invalid_settings(tiny):
    with pytest.raises(pydantic.ValidationError, match="routng"):
        AppConfig.model_validate({"engine": {"model": str(tiny.model_dir)}, "routng": "x"})
    with pytest.raises(pydantic.ValidationError, match="routing"):
        AppConfig.model_validate({"engine": {"model": str(tiny.model_dir)}, "routing": "random"})


def test_demo_resolves_to_built_assets(demo):
    args = {"engine": {"model": "demo"}, "store": {"adapters": "demo"}}
    config = AppConfig.model_validate(args).resolved()
    assert config.engine.model == str(demo.model_dir)
    assert config.store.adapters == {n: str(p) for n, p in demo.adapters.items()}
    assert str(demo.root / "adapters") in config.store.adapter_roots
    assert config.served_model_name == "demo-base"


def test_trained_demo_resolves_to_the_committed_assets():
    from cluster.demo import training as demo_training

    config = serving.load_config(serving.DEFAULT_CONFIG)  # the run command's: the trained demo
    app = AppConfig.model_validate(config["applications"][0]["args"]).resolved()
    assets = demo_training.demo_assets()
    assert app.engine.model == str(assets.model_dir)
    assert app.store.adapters == {n: str(p) for n, p in assets.adapters.items()}
    assert str(assets.root / "adapters") in app.store.adapter_roots
    assert app.served_model_name == "demo-base"


def _replica_config(app):
    replica = app._bound_deployment.init_args[0]  # Ingress(replicas, store, ...)
    return replica._bound_deployment._replica_config


@pytest.mark.parametrize("device,bundle", [("cpu", {"CPU": 1}), ("cuda", {"CPU": 1, "GPU": 1})])
def test_build_app_gives_a_tp_replica_one_bundle_per_rank(tiny, device, bundle):
    engine = {"model": str(tiny.model_dir), "device": device}
    single = _replica_config(build_app({"engine": engine}))
    assert single.placement_group_bundles is None
    assert single.ray_actor_options["num_cpus"] == 1
    tp = _replica_config(build_app({"engine": {**engine, "tp_size": 3}}))
    assert tp.placement_group_bundles == [bundle] * 3
    assert tp.placement_group_strategy == "STRICT_PACK"
    assert tp.ray_actor_options.get("num_gpus", 0) == bundle.get("GPU", 0)


def _router_class(app) -> str:
    replica = app._bound_deployment.init_args[0]  # Ingress(replicas, store, ...)
    return replica._bound_deployment._deployment_config.request_router_config.request_router_class


@pytest.mark.parametrize("routing", ["affinity", "default"])
def test_routing_switch_selects_the_request_router(tiny, routing):
    app = build_app({"engine": {"model": str(tiny.model_dir)}, "routing": {"policy": routing}})
    router = _router_class(app)
    name = router if isinstance(router, str) else f"{router.__module__}.{router.__qualname__}"
    assert ("AdapterAffinityRouter" in name) == (routing == "affinity")


def test_printed_commands_say_where_the_key_must_come_from(monkeypatch):
    """The `try it` commands read the key from $LORAFLEET_API_KEY: when the key is the
    config's api_key (or its runtime_env's), the user's shell does not hold it, and the
    commands say to export it first rather than fail with 401."""
    from cluster.demo import showcase

    monkeypatch.delenv("LORAFLEET_API_KEY", raising=False)
    config = serving.load_config(serving.DEFAULT_CONFIG)
    ingress = config["applications"][0]["args"]["ingress"]
    ingress.pop("api_key", None)
    assert serving.key_for_commands(config) == (None, True)
    ingress["api_key"] = "in-the-config"
    assert serving.key_for_commands(config) == ("LORAFLEET_API_KEY", False)
    monkeypatch.setenv("LORAFLEET_API_KEY", "in-the-config")
    assert serving.key_for_commands(config) == ("LORAFLEET_API_KEY", True)
    monkeypatch.setenv("LORAFLEET_API_KEY", "another")  # the config's key wins
    assert serving.key_for_commands(config) == ("LORAFLEET_API_KEY", False)

    told = showcase.try_it("http://h", "m", "p", "LORAFLEET_API_KEY", key_exported=False)
    assert "export LORAFLEET_API_KEY=<key> first" in told and "in-the-config" not in told
    assert "$LORAFLEET_API_KEY" in told
    assert "export" not in showcase.try_it("http://h", "m", "p", "LORAFLEET_API_KEY")


def test_num_cpus_with_an_address_is_refused_even_with_ray_running(monkeypatch):
    monkeypatch.setattr(serving.ray, "is_initialized", lambda: True)
    with pytest.raises(serving.ServeConfigError, match="--num-cpus"):
        serving.connect("auto", num_cpus=2)
    serving.connect("auto")  # joined already: nothing to do


def test_deploy_refuses_a_taken_port_before_it_starts_serve(monkeypatch):
    """`lorafleet deploy` (and `up --address`) where no Serve runs yet: a port that accepts
    connections is refused before Serve starts its proxy there."""
    import socket

    from ray.serve._private import api as serve_api

    def serve_start(**kwargs):
        raise AssertionError("Serve started")

    monkeypatch.setattr(serve_api, "serve_start", serve_start)
    monkeypatch.setattr(serving, "running_http_address", lambda: None)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        config = serving.apply_overrides(serving.load_config(serving.DEFAULT_CONFIG), port=port)
        with pytest.raises(serving.ServeConfigError, match="already accepts connections"):
            serving.deploy(config)
    assert port not in ports._claimed  # released: nothing holds it after a refusal


class _Status:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_a_failed_start_is_one_line_with_its_cause_and_the_logs(monkeypatch):
    """A deployment that fails inside Serve: its root cause and Ray's log directory, in one
    line, at the first failed start when asked to fail fast (`up`)."""
    from ray import serve

    from tests.cluster.cli_runs import SERVE_FAILURE

    retrying = "A replica failed to start with exception. Retrying 2 more time(s). Error:\n"
    app = _Status(
        status="DEPLOYING",
        message="",
        deployments={
            "Ingress": _Status(status="HEALTHY", message=""),
            "LoRAReplica": _Status(status="UPDATING", message=retrying + SERVE_FAILURE),
        },
    )
    monkeypatch.setattr(serve, "status", lambda: _Status(applications={"lorafleet": app}))
    monkeypatch.setattr(serving, "log_dir", lambda: "/tmp/ray/session_x/logs")
    with pytest.raises(serving.ServeConfigError) as failed:
        serving.wait_until_running(["lorafleet"], timeout_s=5, fail_fast=True)
    assert str(failed.value) == (
        "application 'lorafleet': LoRAReplica failed to start: ModelConfigError: "
        "/m/config.json: unsupported architecture model_type='bert'; supported: llama, "
        "mistral (Ray's logs: /tmp/ray/session_x/logs)"
    )
    app.status, app.message = "DEPLOY_FAILED", "Failed to update the deployments ['LoRAReplica']."
    app.deployments["LoRAReplica"].status = "DEPLOY_FAILED"
    with pytest.raises(serving.ServeConfigError, match="LoRAReplica failed to start: Model"):
        serving.wait_until_running(["lorafleet"], timeout_s=5)  # Serve's own verdict


def test_tenants_add_the_shared_ledger_and_default_to_fair_share(tiny):
    engine = {"model": str(tiny.model_dir)}
    plain = build_app({"engine": engine})._bound_deployment
    assert plain.init_args[5] is None  # no tenants: no ledger, the engine's default order
    assert plain.init_args[0]._bound_deployment.init_args[0]["scheduling"] is None
    tenant = {"name": "t", "key_sha256": ["0" * 64], "requests_per_minute": 5}
    ingress = build_app({"engine": engine, "ingress": {"tenants": [tenant]}})._bound_deployment
    ledger = ingress.init_args[5]._bound_deployment
    assert ledger.name == "TenantLedger" and ledger.init_args == ({"t": (5, None)}, 60.0)
    assert ingress.init_args[0]._bound_deployment.init_args[0]["scheduling"] == "vtc"
    chosen = build_app(
        {"engine": {**engine, "scheduling": "fcfs"}, "ingress": {"tenants": [tenant]}}
    )
    replica = chosen._bound_deployment.init_args[0]._bound_deployment
    assert replica.init_args[0]["scheduling"] == "fcfs"

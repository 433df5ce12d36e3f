"""Serve config files, the command line's overrides, and the application config."""

from __future__ import annotations

import pydantic
import pytest

from cluster import serving
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


@pytest.mark.parametrize("name", ["gpu-1.yaml", "gpu-autoscale.yaml"])
def test_gpu_examples_are_valid(name):
    from ray.serve.schema import ServeDeploySchema

    config = serving.load_config(serving.DEFAULT_CONFIG.parent / name)
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
        settings=["routing=default", "engine.num_slots=5", "load_bound_epsilon=0.5"],
    )
    args = config["applications"][0]["args"]
    assert args["engine"]["model"] == str(tmp_path / "model")
    assert args["engine"]["num_slots"] == 5
    assert args["adapters"] == {"support": str(lora)}
    assert str(tmp_path / "adapters") in args["adapter_roots"]
    assert args["routing"] == "default" and args["load_bound_epsilon"] == 0.5
    replica = config["applications"][0]["deployments"][0]
    assert replica["num_replicas"] == 3 and "autoscaling_config" not in replica
    assert config["http_options"] == {"host": "127.0.0.2", "port": 9123}
    AppConfig.model_validate(args)


def test_own_model_drops_the_demo_adapters(tmp_path):
    config = serving.apply_overrides(serving.load_config(serving.DEFAULT_CONFIG), model="m")
    assert config["applications"][0]["args"]["adapters"] == {}


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
    config = AppConfig.model_validate({"engine": {"model": "demo"}, "adapters": "demo"}).resolved()
    assert config.engine.model == str(demo.model_dir)
    assert config.adapters == {n: str(p) for n, p in demo.adapters.items()}
    assert str(demo.root / "adapters") in config.adapter_roots
    assert config.served_model_name == "demo-base"


def _router_class(app) -> str:
    replica = app._bound_deployment.init_args[0]  # Ingress(replicas, store, ...)
    return replica._bound_deployment._deployment_config.request_router_config.request_router_class


@pytest.mark.parametrize("routing", ["affinity", "default"])
def test_routing_switch_selects_the_request_router(tiny, routing):
    app = build_app({"engine": {"model": str(tiny.model_dir)}, "routing": routing})
    router = _router_class(app)
    name = router if isinstance(router, str) else f"{router.__module__}.{router.__qualname__}"
    assert ("AdapterAffinityRouter" in name) == (routing == "affinity")

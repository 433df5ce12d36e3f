"""The application config's nested shape (engine / ingress / routing / store), the previous
release's flat keys read with a deprecation line each, and what build_app binds."""

from __future__ import annotations

import logging

import pydantic
import pytest
import yaml

from cluster import serving
from cluster.app import build_app, replica_resources
from cluster.config import AppConfig
from replica.config import EngineConfig
from replica.serve.deployment import LoRAReplica
from router.ingress import Ingress

NESTED = {
    "engine": {"model": "m", "adapters": {"num_slots": 4, "host_cache_bytes": 1024}},
    "served_model_name": "base",
    "ingress": {"default_max_tokens": 32},
    "routing": {"policy": "default", "load_bound_floor": 2, "stats_period_s": 0.5},
    "store": {"adapters": {"a": "/adapters/a"}, "adapter_roots": ["/adapters"]}
    | {"resolvers": ["local"]},
}
FLAT = {  # the same settings as the previous release spelled them
    "engine": {"model": "m", "num_slots": 4, "host_cache_bytes": 1024},
    "served_model_name": "base",
    "default_max_tokens": 32,
    "routing": "default",
    "load_bound_floor": 2,
    "routing_stats_period_s": 0.5,
    "adapters": {"a": "/adapters/a"},
    "adapter_roots": ["/adapters"],
    "adapter_resolvers": ["local"],
}
MOVES = {
    "engine.num_slots": "engine.adapters.num_slots",
    "engine.host_cache_bytes": "engine.adapters.host_cache_bytes",
    "default_max_tokens": "ingress.default_max_tokens",
    "routing": "routing.policy",
    "load_bound_floor": "routing.load_bound_floor",
    "routing_stats_period_s": "routing.stats_period_s",
    "adapters": "store.adapters",
    "adapter_roots": "store.adapter_roots",
    "adapter_resolvers": "store.resolvers",
}


def deprecations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def line(old: str, new: str) -> str:
    return f"config key {old} is deprecated: write {new} (the old key goes next release)"


@pytest.mark.old_config_keys
def test_old_flat_keys_are_read_with_one_line_naming_each_new_path(caplog):
    caplog.set_level(logging.WARNING)
    old = AppConfig.model_validate(FLAT)
    assert sorted(deprecations(caplog)) == sorted(line(o, n) for o, n in MOVES.items())
    assert old.model_dump() == AppConfig.model_validate(NESTED).model_dump()
    assert old.routing.policy == "default" and old.engine.adapters.num_slots == 4


def test_the_nested_shape_is_read_without_a_deprecation_line(caplog):
    caplog.set_level(logging.WARNING)
    config = AppConfig.model_validate(NESTED)
    assert deprecations(caplog) == []
    assert config.store.resolvers == ["local"] and config.ingress.default_max_tokens == 32


@pytest.mark.old_config_keys
def test_a_key_given_both_ways_is_refused():
    with pytest.raises(pydantic.ValidationError, match="load_bound_floor and routing"):
        AppConfig.model_validate({**NESTED, "load_bound_floor": 3})
    with pytest.raises(pydantic.ValidationError, match="engine.num_slots and engine.adapters"):
        AppConfig.model_validate({**NESTED, "engine": {**NESTED["engine"], "num_slots": 3}})


@pytest.mark.old_config_keys
def test_set_takes_nested_paths_and_old_flat_ones_with_a_deprecation_line(caplog):
    caplog.set_level(logging.WARNING)
    base = serving.load_config(serving.DEFAULT_CONFIG)
    settings = ["engine.adapters.num_slots=5", "routing.policy=default", "store.demo_adapters=3"]
    new = serving.apply_overrides(base, settings=settings)
    assert deprecations(caplog) == []
    old = serving.apply_overrides(
        base, settings=["engine.num_slots=5", "routing=default", "demo_adapters=3"]
    )
    assert old == new
    assert deprecations(caplog) == [
        line("engine.num_slots", "engine.adapters.num_slots"),
        line("routing", "routing.policy"),
        line("demo_adapters", "store.demo_adapters"),
    ]
    args = new["applications"][0]["args"]
    assert args["engine"]["adapters"]["num_slots"] == 5 and args["store"]["demo_adapters"] == 3
    AppConfig.model_validate(args)


@pytest.mark.old_config_keys
def test_an_old_shape_file_is_upgraded_at_load_and_a_set_sizing_replaces_its_own(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    config = serving.load_config(serving.DEFAULT_CONFIG)
    config["applications"][0]["args"] = {**FLAT, "engine": {"model": "m", "num_slots": 4}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = serving.load_config(path)
    assert len(deprecations(caplog)) == len(MOVES) - 1  # no host_cache_bytes in this file
    setting = "engine.adapters.adapter_memory_bytes=1000000"
    sized = serving.apply_overrides(loaded, settings=[setting])
    assert sized["applications"][0]["args"]["engine"]["adapters"] == {
        "adapter_memory_bytes": 1000000
    }


def test_a_single_cuda_replica_asks_ray_for_a_gpu():
    """tp_size 1 on CUDA: without num_gpus Ray would hide every GPU from the replica."""
    cuda = replica_resources(EngineConfig(model="m", device="cuda:0"))
    assert cuda == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}}
    assert replica_resources(EngineConfig(model="m", device="cpu")) == {
        "ray_actor_options": {"num_cpus": 1}
    }


def test_build_app_makes_every_deployment_and_binds_each_its_section(tiny):
    """The classes carry no Serve decorator (tests construct them); build_app names and
    binds each: the store by keyword, the ingress its section whole."""
    assert type(Ingress) is type and type(LoRAReplica) is type  # tests construct them
    config = {**NESTED, "engine": {"model": str(tiny.model_dir)}, "store": {}}
    ingress = build_app(config)._bound_deployment
    replicas, store = (a._bound_deployment for a in ingress.init_args[:2])
    assert (ingress.name, replicas.name, store.name) == ("Ingress", "LoRAReplica", "AdapterStore")
    assert ingress.init_args[4] == AppConfig.model_validate(NESTED).ingress
    assert ingress.init_kwargs == {"listing_period_s": 0.5}
    assert store.init_args == () and store.init_kwargs["checkpoint"] is True
    assert store.init_kwargs["reserved_names"] == ("base",)
    assert replicas.init_args[0]["adapters"]["num_slots"] is None

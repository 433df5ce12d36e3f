"""build_app: the import_path of lorafleet's Serve configs (`cluster.app:build_app`).

Wires three deployments: the AdapterStore (one replica), the LoRAReplica engines
(routed by AdapterAffinityRouter or Serve's default) and the HTTP Ingress; with tenants, a
fourth: the TenantLedger (one replica: the quotas and usage every Ingress replica shares).
Each is made a deployment here, none at its class's definition: tests construct them as
plain classes (router.ingress.ServedIngress is the Ingress wrapped for HTTP, not yet a
deployment).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import AppConfig, RoutingConfig
from cluster.resolvers import build_resolvers
from cluster.store import AdapterStore
from replica.config import EngineConfig
from replica.serve.deployment import LoRAReplica
from router.affinity import AdapterAffinityRouter
from router.ingress import ServedIngress
from router.ledger import TenantLedger
from router.tenancy import ledger_args

# Serve's default max_ongoing_requests is 5 per replica. The Ingress and the AdapterStore
# only await other actors, so 5 would cap the whole application at 5 requests in flight
# (the proxy queues the rest), whatever the LoRAReplicas could batch. The Serve config's
# `deployments:` section can still set other values.
INGRESS_MAX_ONGOING_REQUESTS = 1024
STORE_MAX_ONGOING_REQUESTS = 1024


def build_app(args: dict[str, Any]) -> Application:
    """The application of Serve config `args` (an AppConfig): every deployment is made
    and sized here, each handed its section of the config whole."""
    config = AppConfig.model_validate(args).resolved()
    store = store_deployment(config)
    replicas = (
        serve.deployment(LoRAReplica, name="LoRAReplica")
        .options(
            request_router_config=router_config(config.routing),
            max_ongoing_requests=config.engine.max_num_seqs * 2,
            max_queued_requests=config.routing.max_queued_requests,
            **replica_resources(config.engine),
        )
        .bind(config.engine.model_dump(), store)
    )
    ledger = None
    if config.ingress.tenants:
        ledger = (
            serve.deployment(TenantLedger, name="TenantLedger")
            .options(
                num_replicas=1,
                max_ongoing_requests=STORE_MAX_ONGOING_REQUESTS,
                ray_actor_options={"num_cpus": 0},
            )
            .bind(*ledger_args(config.ingress))
        )
    return (
        serve.deployment(ServedIngress, name="Ingress")
        .options(
            max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0}
        )
        .bind(
            replicas,
            store,
            config.engine.model,
            config.served_model_name,
            config.ingress,
            ledger,
            listing_period_s=config.routing.stats_period_s,
        )
    )


def store_deployment(config: AppConfig) -> Application:
    """The AdapterStore, one replica, bound to the store section of resolved `config`."""
    engine, store = config.engine, config.store
    return (
        serve.deployment(AdapterStore, name="AdapterStore")
        .options(
            num_replicas=1,
            max_ongoing_requests=STORE_MAX_ONGOING_REQUESTS,
            ray_actor_options={"num_cpus": 0},
        )
        .bind(
            model=engine.model,
            max_lora_rank=engine.max_lora_rank,
            lora_embeddings=engine.lora_embeddings,
            lora_experts=engine.lora_experts,
            adapter_roots=store.adapter_roots,
            preload=store.adapters,
            reserved_names=(config.served_model_name,),
            max_adapter_bytes=store.max_adapter_bytes,
            checkpoint=True,  # a restarted store keeps runtime loads
            resolvers=build_resolvers(
                store.resolvers, store.adapter_roots, store.hf_cache_dir, store.hf_allow_download
            ),
            resolve_allow=store.resolve_allow,
        )
    )


def router_config(routing: RoutingConfig) -> RequestRouterConfig:
    """Serve's request router for the LoRAReplicas: AdapterAffinityRouter or its default."""
    period = routing.stats_period_s
    options: dict[str, Any] = {
        "request_routing_stats_period_s": period,
        "request_routing_stats_timeout_s": max(5.0, 5 * period),
    }
    if routing.policy == "affinity":
        options["request_router_class"] = AdapterAffinityRouter
        options["request_router_kwargs"] = {
            "load_bound_epsilon": routing.load_bound_epsilon,
            "load_bound_floor": routing.load_bound_floor,
            # stats reach the router within a period or two: remember placements that long
            "placement_memory_s": 2 * period,
            "prefix_affinity_tokens": routing.prefix_affinity_tokens,
        }
    return RequestRouterConfig(**options)


def replica_resources(engine: EngineConfig) -> dict[str, Any]:
    """A LoRAReplica's resources: one CPU, and one GPU when the engine runs on CUDA; with
    tp_size N, a placement group of N such bundles, one per rank, all on one node (the
    replica is rank 0 in bundle 0). The Serve config's `deployments:` section may override."""
    gpu = {"num_gpus": 1} if engine.device.startswith("cuda") else {}
    actor = {"ray_actor_options": {"num_cpus": 1, **gpu}}
    if engine.tp_size == 1:
        return actor
    bundle = {"CPU": 1, **({"GPU": 1} if gpu else {})}
    return actor | {
        "placement_group_bundles": [dict(bundle) for _ in range(engine.tp_size)],
        "placement_group_strategy": "STRICT_PACK",
    }

"""build_app: the import_path of lorafleet's Serve configs (`cluster.app:build_app`).

Wires three deployments: the AdapterStore (one replica), the LoRAReplica engines
(routed by AdapterAffinityRouter or Serve's default) and the HTTP Ingress; with tenants, a
fourth: the TenantLedger (one replica: the quotas and usage every Ingress replica shares).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import AppConfig
from cluster.resolvers import build_resolvers
from cluster.store import AdapterStore
from replica.config import EngineConfig
from replica.serve.deployment import LoRAReplica
from router.affinity import AdapterAffinityRouter
from router.ingress import Ingress
from router.ledger import TenantLedger
from router.options import IngressOptions
from router.tenancy import ledger_args

# Serve's default max_ongoing_requests is 5 per replica. The Ingress and the AdapterStore
# only await other actors, so 5 would cap the whole application at 5 requests in flight
# (the proxy queues the rest), whatever the LoRAReplicas could batch. The Serve config's
# `deployments:` section can still set other values.
INGRESS_MAX_ONGOING_REQUESTS = 1024
STORE_MAX_ONGOING_REQUESTS = 1024


def build_app(args: dict[str, Any]) -> Application:
    config = AppConfig.model_validate(args).resolved()
    engine = config.engine
    store = (
        serve.deployment(AdapterStore)
        .options(
            name="AdapterStore",
            num_replicas=1,
            max_ongoing_requests=STORE_MAX_ONGOING_REQUESTS,
            ray_actor_options={"num_cpus": 0},
        )
        .bind(
            engine.model,
            engine.max_lora_rank,
            config.adapter_roots,
            config.adapters,
            (config.served_model_name,),
            config.max_adapter_bytes,
            True,  # checkpoint the registry: a restarted store keeps runtime loads
            build_resolvers(
                config.adapter_resolvers,
                config.adapter_roots,
                config.hf_cache_dir,
                config.hf_allow_download,
            ),
            config.resolve_allow,
            engine.lora_embeddings,
        )
    )
    routing: dict[str, Any] = {
        "request_routing_stats_period_s": config.routing_stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 5 * config.routing_stats_period_s),
    }
    if config.routing == "affinity":
        routing["request_router_class"] = AdapterAffinityRouter
        routing["request_router_kwargs"] = {
            "load_bound_epsilon": config.load_bound_epsilon,
            "load_bound_floor": config.load_bound_floor,
            # stats reach the router within a period or two: remember placements that long
            "placement_memory_s": 2 * config.routing_stats_period_s,
            "prefix_affinity_tokens": config.prefix_affinity_tokens,
        }
    router_config = RequestRouterConfig(**routing)
    replicas = LoRAReplica.options(
        request_router_config=router_config,
        max_ongoing_requests=engine.max_num_seqs * 2,
        max_queued_requests=config.max_queued_requests,
        **replica_resources(engine),
    ).bind(engine.model_dump(), store)
    options = IngressOptions(**config.model_dump(include=set(IngressOptions.model_fields)))
    ledger = None
    if options.tenants:
        ledger = (
            serve.deployment(TenantLedger)
            .options(
                name="TenantLedger",
                num_replicas=1,
                max_ongoing_requests=STORE_MAX_ONGOING_REQUESTS,
                ray_actor_options={"num_cpus": 0},
            )
            .bind(*ledger_args(options))
        )
    return Ingress.options(
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0}
    ).bind(replicas, store, engine.model, config.served_model_name, options, ledger)


def replica_resources(engine: EngineConfig) -> dict[str, Any]:
    """A LoRAReplica's resources: one CPU; with tp_size N, a placement group of N bundles,
    one per rank (one CPU, and one GPU when the engine runs on CUDA), all on one node. The
    replica is rank 0 in bundle 0; the Serve config's `deployments:` section may override."""
    if engine.tp_size == 1:
        return {"ray_actor_options": {"num_cpus": 1}}
    gpu = engine.device.startswith("cuda")
    bundle = {"CPU": 1, **({"GPU": 1} if gpu else {})}
    return {
        "ray_actor_options": {"num_cpus": 1, **({"num_gpus": 1} if gpu else {})},
        "placement_group_bundles": [dict(bundle) for _ in range(engine.tp_size)],
        "placement_group_strategy": "STRICT_PACK",
    }

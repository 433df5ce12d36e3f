"""The application config: one pydantic model for every knob of a lorafleet Serve app.

It is the `args:` block of a Serve config file (configs/serve.yaml) and what
`build_app` validates. Like Ray Serve LLM's LLMConfig it nests one section per part,
each handed whole to that part: `engine:` (its `adapters:` the residency knobs),
`ingress:`, `routing:` and `store:`. Deployment sizing (replicas, autoscaling,
resources) stays in the Serve config's `deployments:` section, where `serve deploy`
updates it in place.

The flat keys of the previous release (`routing: default`, `adapter_roots:`,
`engine.num_slots` ...) are still read, each moved to its new path with a deprecation
line (`upgrade_args`); they go in the next release.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replica.config import AdapterResidencyConfig, EngineConfig, moved_key, nest_adapter_keys
from router.options import IngressOptions

if TYPE_CHECKING:
    from cluster.demo.assets import DemoAssets

DEMO = "demo"  # engine.model / store.adapters value: the demo model and adapters, built if missing
DEMO_TRAINED = "demo-trained"  # the trained demo committed under assets/ (cluster/demo/training.py)
DEMOS = (DEMO, DEMO_TRAINED)


class RoutingConfig(BaseModel):
    """How requests reach LoRAReplicas: the request router and its queue."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["affinity", "default"] = Field(
        "affinity",
        description="'affinity': AdapterAffinityRouter; 'default': Serve's power-of-two router "
        "(for comparison).",
    )
    load_bound_epsilon: float = Field(
        0.25, ge=0.0, description="Affinity load bound: at most (1+eps) x the mean load."
    )
    load_bound_floor: int = Field(
        4, ge=0, description="Affinity keeps a replica whose queue is under this many requests."
    )
    prefix_affinity_tokens: int = Field(
        16,
        ge=0,
        description="Affinity routing also keeps prompt prefixes together: requests whose "
        "first this-many prompt tokens (and model) agree go to the same replica, where that "
        "prefix is cached, within the load bound. 0 turns it off.",
    )
    stats_period_s: float = Field(
        1.0,
        gt=0,
        description="How often replicas publish residency and load to the router; the "
        "ingress refreshes its list of adapters as often.",
    )
    max_queued_requests: int = Field(
        512,
        ge=-1,
        description="Requests waiting for a LoRAReplica beyond its max_ongoing_requests; more "
        "are refused with 429 and Retry-After (-1: unbounded).",
    )


class StoreConfig(BaseModel):
    """The AdapterStore's registry: adapters at start, where loads may read, resolvers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: dict[str, str] | Literal["demo", "demo-trained"] = Field(  # the names in DEMOS
        default_factory=dict,
        description="Adapters registered at start: name -> PEFT directory, or 'demo' / "
        "'demo-trained' (the demo's adapters; with engine.model the same demo).",
    )
    demo_adapters: int = Field(8, ge=1, le=256, description="How many 'demo' adapters to build.")
    adapter_roots: list[str] = Field(
        default_factory=list,
        description="Directories that runtime loads (POST /v1/load_lora_adapter) may read "
        "from; empty disables runtime loading. The demo adapters' directory is added for demo.",
    )
    max_adapter_bytes: int = Field(
        4 * 2**30,
        gt=0,
        description="Largest adapter weights file (adapter_model.safetensors or .bin) the "
        "store accepts.",
    )
    resolvers: list[Literal["local", "hf_cache"]] = Field(
        default_factory=list,
        description="Where a request's unknown adapter name is looked up, in this order, "
        "before it is a 404 (the adapter is then registered as by POST "
        "/v1/load_lora_adapter, same checks): 'local' = the subdirectory of that name in "
        "an adapter root; 'hf_cache' = for an 'org/name', that Hugging Face repo's snapshot "
        "in the local hub cache. Empty: nothing resolves.",
    )
    resolve_allow: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns (fnmatch, case-sensitive; '*' matches '/' too) of the "
        "names that resolvers may resolve, e.g. ['myorg/*', 'support-*']; a name "
        "matching none is a 404 without any lookup.",
    )
    hf_cache_dir: str | None = Field(
        None,
        description="The Hugging Face hub cache the 'hf_cache' resolver reads (default: "
        "huggingface_hub's, i.e. $HF_HUB_CACHE or $HF_HOME/hub).",
    )
    hf_allow_download: bool = Field(
        False,
        description="Let the 'hf_cache' resolver download an adapter missing from the cache "
        "(its two adapter files) from the Hugging Face hub; off: nothing leaves the machine.",
    )

    @field_validator("adapters")
    @classmethod
    def _names(cls, v: dict[str, str] | str) -> dict[str, str] | str:
        if isinstance(v, dict):
            for name in v:
                if not name or "/" in name:
                    raise ValueError(f"adapter name {name!r}: must be non-empty, without '/'")
        return v

    @model_validator(mode="after")
    def _resolvers(self) -> StoreConfig:
        kinds = self.resolvers
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"resolvers: each resolver at most once, got {kinds}")
        if "local" in kinds and not self.adapter_roots and self.adapters not in DEMOS:
            raise ValueError("resolvers: 'local' needs adapter_roots to look in")
        return self


class AppConfig(BaseModel):
    """Every knob of the application, one section per part it configures."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(
        description="The replica engine's settings; engine.model may be 'demo' (random weights, "
        "built if missing) or 'demo-trained' (committed under assets/demo-trained)."
    )
    served_model_name: str | None = Field(
        None, description="The base model's name in the API (default: the model directory name)."
    )
    ingress: IngressOptions = Field(
        default_factory=IngressOptions,
        description="The HTTP ingress: default max_tokens, request timeout, API keys, tenants.",
    )
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="The request router between the ingress and the replicas.",
    )
    store: StoreConfig = Field(
        default_factory=StoreConfig,
        description="The AdapterStore: adapters at start, adapter roots, resolvers.",
    )

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, values: Any) -> Any:
        return upgrade_args(values) if isinstance(values, dict) else values

    def resolved(self) -> AppConfig:
        """'demo' replaced by built (cached) demo assets; names and paths made explicit;
        the engine's scheduling vtc when unset and tenants are configured."""
        engine, store = self.engine, self.store
        adapters, roots = store.adapters, list(store.adapter_roots)
        for demo in sorted({v for v in (engine.model, adapters) if isinstance(v, str)} & {*DEMOS}):
            assets = _demo_assets(demo, store.demo_adapters)
            if engine.model == demo:
                engine = engine.model_copy(update={"model": str(assets.model_dir)})
            if adapters == demo:
                adapters = {n: str(p) for n, p in assets.adapters.items()}
                roots.append(str(assets.root / "adapters"))
        if self.ingress.tenants and engine.scheduling is None:  # fair share between tenants
            engine = engine.model_copy(update={"scheduling": "vtc"})
        default_name = "demo-base" if self.engine.model in DEMOS else Path(engine.model).name
        return self.model_copy(
            update={
                "engine": engine,
                "store": store.model_copy(update={"adapters": adapters, "adapter_roots": roots}),
                "served_model_name": self.served_model_name or default_name,
            }
        )


# The previous release's flat keys -> their paths now (the engine's own moves are
# replica.config.nest_adapter_keys').
MOVED_KEYS: dict[str, str] = {
    **{
        k: f"ingress.{k}"
        for k in ("default_max_tokens", "request_timeout_s", "api_key", "api_key_env")
        + ("api_key_for_inference", "tenants", "rate_limit_window_s", "tenant_metric_labels")
        + ("tool_parser", "reasoning_parser", "adapter_parsers")
    },
    "routing_stats_period_s": "routing.stats_period_s",
    **{
        k: f"routing.{k}"
        for k in ("load_bound_epsilon", "load_bound_floor", "prefix_affinity_tokens")
        + ("max_queued_requests",)
    },
    "adapter_resolvers": "store.resolvers",
    **{
        k: f"store.{k}"
        for k in ("adapters", "demo_adapters", "adapter_roots", "max_adapter_bytes")
        + ("resolve_allow", "hf_cache_dir", "hf_allow_download")
    },
}


def upgrade_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` (an AppConfig's values) in the nested shape: every flat key of the previous
    release moved to its section, with one deprecation line naming its new path. A key
    given both ways is an error, not a silent choice."""
    args = dict(args)
    if isinstance(args.get("routing"), str):  # the old `routing: affinity | default`
        moved_key("routing", "routing.policy")
        args["routing"] = {"policy": args["routing"]}
    for old in [k for k in MOVED_KEYS if k in args]:
        new = MOVED_KEYS[old]
        section, leaf = new.split(".")
        node = args.get(section) or {}
        if isinstance(node, BaseModel):
            node = node.model_dump(exclude_unset=True)
        if leaf in node:
            raise ValueError(f"{old} and {new} both set: keep the second")
        moved_key(old, new)
        args[section] = {**node, leaf: args.pop(old)}
    if isinstance(args.get("engine"), dict):
        args["engine"] = nest_adapter_keys(args["engine"])
    return args


def upgrade_setting(key: str, value: Any) -> str:
    """Dotted path `key` of a setting (`--set KEY=VALUE`) in the nested shape, with one
    deprecation line when it moved: "adapter_roots" -> "store.adapter_roots",
    "engine.num_slots" -> "engine.adapters.num_slots", "routing" (a policy name) ->
    "routing.policy"."""
    head, dot, rest = key.partition(".")
    if key == "routing" and isinstance(value, str):
        new = "routing.policy"
    elif head in MOVED_KEYS:
        new = MOVED_KEYS[head] + dot + rest
    elif head == "engine" and rest.partition(".")[0] in AdapterResidencyConfig.model_fields:
        new = f"engine.adapters.{rest}"
    else:
        return key
    moved_key(key, new)
    return new


def _demo_assets(which: str, num_adapters: int) -> DemoAssets:
    if which == DEMO_TRAINED:
        from cluster.demo.training import demo_assets

        return demo_assets()
    from cluster.demo.assets import DemoSpec, cached_demo_assets

    return cached_demo_assets(DemoSpec(num_adapters=num_adapters))

"""The application config: one pydantic model for every knob of a lorafleet Serve app.

It is the `args:` block of a Serve config file (configs/serve.yaml) and what
`build_app` validates. Deployment sizing (replicas, autoscaling, resources) stays
in the Serve config's `deployments:` section, where `serve deploy` updates it in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from replica.config import EngineConfig
from router.options import IngressOptions

if TYPE_CHECKING:
    from cluster.demo.assets import DemoAssets

DEMO = "demo"  # engine.model / adapters value: the demo model and adapters, built if missing
DEMO_TRAINED = "demo-trained"  # the trained demo committed under assets/ (cluster/demo/training.py)
DEMOS = (DEMO, DEMO_TRAINED)


class AppConfig(IngressOptions):
    """Every knob of the application; the ingress's own (default_max_tokens, request
    timeout, API keys) are inherited from router.options.IngressOptions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = Field(
        description="The replica engine's settings; engine.model may be 'demo' (random weights, "
        "built if missing) or 'demo-trained' (committed under assets/demo-trained)."
    )
    served_model_name: str | None = Field(
        None, description="The base model's name in the API (default: the model directory name)."
    )
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
    routing: Literal["affinity", "default"] = Field(
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
    max_queued_requests: int = Field(
        512,
        ge=-1,
        description="Requests waiting for a LoRAReplica beyond its max_ongoing_requests; more "
        "are refused with 429 and Retry-After (-1: unbounded).",
    )
    max_adapter_bytes: int = Field(
        4 * 2**30,
        gt=0,
        description="Largest adapter weights file (adapter_model.safetensors or .bin) the "
        "store accepts.",
    )
    adapter_resolvers: list[Literal["local", "hf_cache"]] = Field(
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
        "names that adapter_resolvers may resolve, e.g. ['myorg/*', 'support-*']; a name "
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
    def _resolvers(self) -> AppConfig:
        kinds = self.adapter_resolvers
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"adapter_resolvers: each resolver at most once, got {kinds}")
        if "local" in kinds and not self.adapter_roots and self.adapters not in DEMOS:
            raise ValueError("adapter_resolvers: 'local' needs adapter_roots to look in")
        return self

    def resolved(self) -> AppConfig:
        """'demo' replaced by built (cached) demo assets; names and paths made explicit;
        the engine's scheduling vtc when unset and tenants are configured."""
        engine, adapters, roots = self.engine, self.adapters, list(self.adapter_roots)
        for demo in sorted({v for v in (engine.model, adapters) if isinstance(v, str)} & {*DEMOS}):
            assets = _demo_assets(demo, self.demo_adapters)
            if engine.model == demo:
                engine = engine.model_copy(update={"model": str(assets.model_dir)})
            if adapters == demo:
                adapters = {n: str(p) for n, p in assets.adapters.items()}
                roots.append(str(assets.root / "adapters"))
        if self.tenants and engine.scheduling is None:  # fair share between tenants
            engine = engine.model_copy(update={"scheduling": "vtc"})
        default_name = "demo-base" if self.engine.model in DEMOS else Path(engine.model).name
        name = self.served_model_name or default_name
        return self.model_copy(
            update={
                "engine": engine,
                "adapters": adapters,
                "adapter_roots": roots,
                "served_model_name": name,
            }
        )


def _demo_assets(which: str, num_adapters: int) -> DemoAssets:
    if which == DEMO_TRAINED:
        from cluster.demo.training import demo_assets

        return demo_assets()
    from cluster.demo.assets import DemoSpec, cached_demo_assets

    return cached_demo_assets(DemoSpec(num_adapters=num_adapters))

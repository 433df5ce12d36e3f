"""Shared fixtures: demo assets built once per machine and reused (see cluster.demo.assets)."""

from __future__ import annotations

import os

import pytest
import torch

# Kernel tests run Triton compiled where CUDA is present and in its interpreter elsewhere;
# the switch is read when triton decorates the kernels, so it is set before any import of them.
CUDA = torch.cuda.is_available()
TEST_DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on a GPU machine)")

# Under pytest-xdist (make test, make test-fast: a worker per core) each worker computes on
# one thread, and so do the processes its tests start: torch's default, a thread per core in
# every worker, oversubscribes the cores, and OpenMP's threads spin waiting on each other
# (the model and bench tests took 3.5x as long).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from cluster.demo.assets import DemoAssets, DemoSpec, cached_demo_assets, tiny_spec  # noqa: E402


@pytest.fixture(scope="session")
def demo() -> DemoAssets:
    """The default demo model (hidden 512, 8 layers, GQA) and its 8 adapters."""
    return cached_demo_assets(DemoSpec())


@pytest.fixture(scope="session")
def tiny() -> DemoAssets:
    """A tiny Llama with 4 adapters, for fast engine tests."""
    return cached_demo_assets(tiny_spec("llama"))


def tiny_assets(arch: str, **overrides) -> DemoAssets:
    return cached_demo_assets(tiny_spec(arch, **overrides))


# Deployment options for the Serve apps the tests deploy. A stopping replica (serve.shutdown,
# a redeploy, a scale-down) sleeps graceful_shutdown_wait_loop_s (Serve's default: 2 s)
# before it first looks for requests still running, then looks again that often: each
# serve.shutdown of a test app took ~7 s here, ~2 s with this. Requests in flight are still
# waited for (up to graceful_shutdown_timeout_s), only looked for more often.
QUICK_STOP = {"graceful_shutdown_wait_loop_s": 0.1}


def serve_config(port: int, args: dict, deployments: list[dict], **app: object) -> dict:
    """A Serve config of the lorafleet application alone (cluster.app:build_app with `args`,
    its `deployments` options and any other application field), its HTTP proxy on the
    head node at 127.0.0.1:`port`: what the suite's Ray tests deploy."""
    application = {"name": "lorafleet", "route_prefix": "/",
                   "import_path": "cluster.app:build_app", **app, "args": args,
                   "deployments": deployments}  # fmt: skip
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [application]}  # fmt: skip


@pytest.fixture(autouse=True)
def _config_in_the_current_shape(request: pytest.FixtureRequest, monkeypatch) -> None:
    """A deprecated flat config key fails the test that wrote it, unless it is marked
    old_config_keys (the tests of the deprecation path): the suite exercises the shape
    users are told to write."""
    if request.node.get_closest_marker("old_config_keys"):
        return

    def refuse(old: str, new: str) -> None:
        raise AssertionError(f"the test writes the deprecated config key {old}: write {new}")

    import cluster.config
    import replica.config

    monkeypatch.setattr(replica.config, "moved_key", refuse)
    monkeypatch.setattr(cluster.config, "moved_key", refuse)

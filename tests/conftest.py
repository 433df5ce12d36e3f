"""Shared fixtures: demo assets built once per machine and reused (see cluster.demo_assets)."""

from __future__ import annotations

import pytest

from cluster.demo_assets import DemoAssets, DemoSpec, cached_demo_assets, tiny_spec


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

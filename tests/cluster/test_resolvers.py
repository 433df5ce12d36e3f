"""Adapter resolvers on their own (no Ray): which directory a name maps to, and which
names are refused before anything on disk is looked at. The store's use of them (limits,
one resolution per name, registration) is in test_adapter_registry.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest

from cluster.resolvers import (
    ADAPTER_FILES,
    HFCacheResolver,
    LocalDirResolver,
    ResolveError,
    allowed,
    build_resolvers,
)
from tests.fakes import fake_hf_cache


@pytest.fixture
def adapter(tiny) -> Path:
    return tiny.adapters["adapter-00"]


@pytest.fixture
def no_disk(monkeypatch):
    """Any filesystem look-up through pathlib or os.stat fails the test."""

    def touched(*args, **kwargs):
        raise AssertionError(f"the resolver looked at the disk: {args}")

    for attr in ("is_dir", "exists", "resolve", "stat", "iterdir"):
        monkeypatch.setattr(Path, attr, touched)
    monkeypatch.setattr(os, "stat", touched)


# -- local directories ---------------------------------------------------------------------


def test_local_resolver_finds_the_named_subdirectory_of_the_first_root_that_has_it(
    tmp_path, adapter
):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    shutil.copytree(adapter, second / "support")
    found = LocalDirResolver([first, second]).find("support")
    assert found.path == (second / "support").resolve() and found.roots == (second.resolve(),)
    assert found.source == "local"
    shutil.copytree(adapter, first / "support")
    assert LocalDirResolver([first, second]).find("support").path == first.resolve() / "support"


def test_local_resolver_says_when_no_root_has_the_name(tmp_path):
    with pytest.raises(ResolveError, match="no adapter root has a directory of that name"):
        LocalDirResolver([tmp_path]).find("absent")


@pytest.mark.parametrize(
    "name",
    ["..", ".", "../x", "a/../../x", "/etc/passwd", "a\x00b", ".hidden", "", "a/b", "x" * 129],
)
def test_local_resolver_refuses_names_that_are_not_one_directory_name_without_reading(
    tmp_path, name, no_disk
):
    resolver = LocalDirResolver.__new__(LocalDirResolver)  # built without touching the disk
    resolver.roots = (tmp_path,)
    with pytest.raises(ResolveError, match="not a directory name"):
        resolver.find(name)


def test_local_resolver_needs_roots():
    with pytest.raises(ValueError, match="adapter_roots"):
        LocalDirResolver([])


# -- the Hugging Face hub cache -------------------------------------------------------------


def test_hf_resolver_finds_the_snapshot_in_the_cache(tmp_path, adapter):
    snapshot = fake_hf_cache(tmp_path / "hub", "acme/support-lora", adapter)
    found = HFCacheResolver(tmp_path / "hub").find("acme/support-lora")
    assert found.path.resolve() == snapshot.resolve()
    assert found.roots == ((tmp_path / "hub" / "models--acme--support-lora").resolve(),)
    assert found.source == "hf_cache"
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        # the links resolve inside the repo's folder
        assert (found.path / name).resolve().is_relative_to(found.roots[0])


def test_hf_resolver_reads_the_cache_that_hf_hub_cache_names(tmp_path, adapter, monkeypatch):
    fake_hf_cache(tmp_path / "hub", "acme/x", adapter)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert HFCacheResolver().find("acme/x").source == "hf_cache"


def test_hf_resolver_does_not_download_unless_allowed(tmp_path, monkeypatch):
    calls = []

    def download(repo_id, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise AssertionError("downloaded without permission")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(ResolveError, match="not in the Hugging Face cache.*hf_allow_download"):
        HFCacheResolver(tmp_path).find("acme/missing")
    assert [c["local_files_only"] for c in calls] == [True]


def test_hf_resolver_downloads_only_the_adapter_files_when_allowed(tmp_path, adapter, monkeypatch):
    real = huggingface_hub.snapshot_download
    asked = []

    def download(repo_id, **kwargs):
        if not kwargs.get("local_files_only"):  # "the hub": fills the cache
            asked.append(kwargs["allow_patterns"])
            fake_hf_cache(Path(kwargs["cache_dir"]), repo_id, adapter)
        return real(repo_id, **{**kwargs, "local_files_only": True})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    found = HFCacheResolver(tmp_path, allow_download=True).find("acme/fresh")
    assert asked == [list(ADAPTER_FILES)]
    assert (found.path / "adapter_model.safetensors").is_file()


def test_hf_resolver_reports_a_failed_download(tmp_path, monkeypatch):
    def download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(ResolveError, match="download .* failed: network unreachable"):
        HFCacheResolver(tmp_path, allow_download=True).find("acme/x")


@pytest.mark.parametrize("name", ["plain", "a/b/c", "acme/../x", "acme/x--y", "../x", "/abs/x"])
def test_hf_resolver_refuses_what_is_not_a_repo_id_without_reading(tmp_path, name, no_disk):
    with pytest.raises(ResolveError, match="repo id"):
        HFCacheResolver(tmp_path).find(name)


# -- configuration ---------------------------------------------------------------------------


def test_allow_list_globs():
    assert allowed("acme/support", ["acme/*"]) and allowed("acme/support", ["*"])
    assert not allowed("other/support", ["acme/*"]) and not allowed("x", [])
    assert allowed("support-7", ["nope", "support-?"])
    assert not allowed("Support-7", ["support-*"])  # case-sensitive


def test_build_resolvers_keeps_the_configured_order(tmp_path):
    kinds = [r.kind for r in build_resolvers(["hf_cache", "local"], [str(tmp_path)])]
    assert kinds == ["hf_cache", "local"]
    with pytest.raises(ValueError, match="unknown adapter resolver 's3'"):
        build_resolvers(["s3"], [])


def test_app_config_checks_the_resolver_settings(tmp_path):
    from cluster.config import AppConfig

    base = {"engine": {"model": str(tmp_path)}}

    def store(**values):
        return AppConfig.model_validate({**base, "store": values}).store

    config = store(adapter_roots=[str(tmp_path)], resolvers=["local", "hf_cache"])
    assert config.resolve_allow == ["*"] and not config.hf_allow_download
    assert AppConfig.model_validate(base).store.resolvers == []  # nothing resolves
    with pytest.raises(ValueError, match="'local' needs adapter_roots"):
        store(resolvers=["local"])
    with pytest.raises(ValueError, match="each resolver at most once"):
        store(resolvers=["hf_cache", "hf_cache"])
    with pytest.raises(ValueError, match="store.resolvers"):
        store(resolvers=["s3"])

"""The AdapterStore without Serve (a local Ray for the object store and the checkpoint
actor): adapters resolved on first request, the incremental checkpoint, replica reports
that carry changes only, and a registry of 4,096 adapters."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import shutil
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from cluster.resolvers import HFCacheResolver, LocalDirResolver
from cluster.store import AdapterStore, deployment, reports
from cluster.store.checkpoint import NAMESPACE, Checkpoint
from replica.wire import AdapterInfo, AdapterKey, RegistryEpoch
from router.errors import BadRequestError, NotFoundError
from tests.fakes import fake_hf_cache

BASE = "tiny-base"
pytestmark = pytest.mark.ray  # local_ray: tests/conftest.py keeps it off the other worker


def run(coro: Any) -> Any:
    """One store call outside an event loop (the store's methods are all async)."""
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def local_ray():
    # a Ray of its own, even where another test run has one going on this machine
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def root(tmp_path, tiny) -> Path:
    """An adapter root holding copies of two of the tiny adapters (rank 8 and rank 16)."""
    root = tmp_path / "adapters"
    for name in ("adapter-00", "adapter-01"):
        shutil.copytree(tiny.adapters[name], root / name)
    return root


@pytest.fixture
def checkpoint(monkeypatch, local_ray) -> str:
    """A checkpoint actor name of this test's own (Serve's app name is not there)."""
    name = f"test-registry/{uuid.uuid4().hex}"
    monkeypatch.setattr(deployment, "checkpoint_name", lambda: name)
    yield name
    ray.kill(ray.get_actor(name, namespace=NAMESPACE))


def make_store(tiny, root: Path, local_ray=None, **kwargs) -> AdapterStore:
    kwargs.setdefault("reserved_names", (BASE,))
    kwargs.setdefault("preload", {})
    return AdapterStore(
        model=str(tiny.model_dir), max_lora_rank=64, adapter_roots=[str(root)], **kwargs
    )


def local_store(tiny, root: Path, **kwargs) -> AdapterStore:
    return make_store(tiny, root, resolvers=[LocalDirResolver([root])], **kwargs)


def listed(store: AdapterStore) -> tuple[AdapterInfo, ...]:
    """Every adapter the store lists (its listing, taken without a tag)."""
    return run(store.listing()).adapters


def saved(name: str) -> dict[str, AdapterInfo]:
    """What checkpoint actor `name` holds, per adapter name."""
    return Checkpoint(name).restore().adapters


async def refusal(store: AdapterStore, name: str) -> str:
    """The message of the 404 resolving `name` ends in."""
    with pytest.raises(NotFoundError) as e:
        await store.resolve(name)
    return e.value.message


class Writes:
    """Records the checkpoint writes: (what, adapter name or "meta")."""

    def __init__(self, monkeypatch) -> None:
        self.done: list[tuple[str, str]] = []
        write = Checkpoint._write

        async def recording(checkpoint, method, *args):
            self.done.append((method, "meta" if method == "put_meta" else args[0]))
            return await write(checkpoint, method, *args)

        monkeypatch.setattr(Checkpoint, "_write", recording)

    def during(self, action) -> list[tuple[str, str]]:
        start = len(self.done)
        action()
        return self.done[start:]


def test_every_store_method_runs_on_the_event_loop():
    """Serve runs a deployment's sync methods on a thread pool: one reading the registry
    there could see a registration half done on the event loop."""
    public = [n for n, f in vars(AdapterStore).items() if callable(f) and not n.startswith("_")]
    assert {"resolve", "register", "get_weights", "listing", "report_replica"} <= set(public)
    assert [n for n in public if not inspect.iscoroutinefunction(getattr(AdapterStore, n))] == []


# -- resolution on first request ---------------------------------------------------------------


def test_an_unregistered_adapter_in_a_root_is_registered_on_first_request(tiny, root, local_ray):
    store = local_store(tiny, root)

    async def main():
        info = await store.resolve("adapter-01")
        assert (info.name, info.rank, info.source) == ("adapter-01", 16, "local")
        assert info.path == str((root / "adapter-01").resolve())
        assert await store.resolve("adapter-01") == info  # registered: no second lookup
        assert [i.name for i in (await store.listing()).adapters] == ["adapter-01"]
        # per projection group, computed at conversion: replicas reserve exactly these rows
        assert info.ranks == {"qkv_proj": 16, "o_proj": 16}
        stored = await store.get_weights(info.key)
        assert stored.info == info and ray.get(stored.weights) is not None
        # as an explicit load would: taken, so a plain load of the name is refused
        with pytest.raises(BadRequestError, match="already registered"):
            await store.register("adapter-01", str(root / "adapter-01"))

    asyncio.run(main())
    assert run(store.stats())["num_resolved"] == 1 and store.registry.num_puts == 1


def test_concurrent_first_requests_share_one_resolution(tiny, root, local_ray, monkeypatch):
    store = local_store(tiny, root)
    finds = []
    find = store.registry.resolvers[0].find

    def slow_find(name):
        finds.append(name)
        time.sleep(0.2)  # long enough for every request to arrive meanwhile
        return find(name)

    monkeypatch.setattr(store.registry.resolvers[0], "find", slow_find)

    async def main():
        return await asyncio.gather(*(store.resolve("adapter-00") for _ in range(10)))

    infos = asyncio.run(main())
    assert finds == ["adapter-00"] and store.registry.num_puts == 1
    assert len({(i.name, i.version) for i in infos}) == 1
    assert store.registry._resolving == {}  # nothing left behind


def test_a_failed_resolution_is_404_with_the_reason_and_registers_nothing(tiny, root, local_ray):
    store = local_store(tiny, root, max_adapter_bytes=10**9, resolve_allow=["adapter-*", "x*"])

    async def refused(name: str) -> str:
        with pytest.raises(NotFoundError) as e:
            await store.resolve(name)
        return e.value.message

    async def main():
        assert "no resolver found it (local: no adapter root has a directory" in (
            await refused("adapter-99")
        )
        assert "resolve_allow" in await refused("other")
        assert "not a directory name" in await refused("x/../../etc")
        (root / "adapter-02").mkdir()  # a directory, not an adapter
        assert "not a valid adapter" in await refused("adapter-02")

    asyncio.run(main())
    assert listed(store) == () and store.registry.num_puts == 0


def test_names_outside_the_allow_list_are_never_looked_up(tiny, root, local_ray, monkeypatch):
    store = local_store(tiny, root, resolve_allow=["support-*"])
    monkeypatch.setattr(store.registry.resolvers[0], "find", lambda name: pytest.fail("looked up"))

    async def main():
        for name in ("adapter-00", "../adapter-00", "support/../../x" + "\x00"):
            if name.startswith("support"):
                continue
            with pytest.raises(NotFoundError, match="resolve_allow"):
                await store.resolve(name)

    asyncio.run(main())


def test_resolved_adapters_meet_the_limits_of_explicit_loads(tiny, root, tmp_path, local_ray):
    """Rank, size and path confinement: a symlink out of the root is refused."""
    outside = tmp_path / "outside"
    shutil.copytree(tiny.adapters["adapter-00"], outside)
    (root / "escape").symlink_to(outside)
    shutil.copytree(tiny.adapters["adapter-02"], root / "rank32")
    shutil.copytree(tiny.adapters["adapter-00"], root / "big")
    size = (root / "big" / "adapter_model.safetensors").stat().st_size
    with open(root / "big" / "adapter_model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    store = make_store(tiny, root, resolvers=[LocalDirResolver([root])], max_adapter_bytes=size)
    store.registry.converter.max_lora_rank = 16

    async def main():
        assert "outside the configured adapter roots" in await refusal(store, "escape")
        assert "max_adapter_bytes" in await refusal(store, "big")
        assert "exceeds max_lora_rank" in await refusal(store, "rank32")
        assert (await store.resolve("adapter-00")).rank == 8

    asyncio.run(main())
    assert [i.name for i in listed(store)] == ["adapter-00"]


def test_bin_weights_meet_the_same_confinement_and_size_limits(tiny, root, tmp_path, local_ray):
    """An adapter_model.bin is read like the safetensors file, so the same checks hold: a
    .bin linked out of the roots is refused, one over max_adapter_bytes too."""
    from safetensors.torch import load_file

    weights = load_file(tiny.adapters["adapter-00"] / "adapter_model.safetensors")
    outside = tmp_path / "outside.bin"
    torch.save(weights, outside)
    for name in ("linked", "big", "plain"):
        (root / name).mkdir()
        shutil.copy(tiny.adapters["adapter-00"] / "adapter_config.json", root / name)
    (root / "linked" / "adapter_model.bin").symlink_to(outside)
    shutil.copy(outside, root / "plain" / "adapter_model.bin")
    size = outside.stat().st_size
    shutil.copy(outside, root / "big" / "adapter_model.bin")
    with open(root / "big" / "adapter_model.bin", "ab") as f:
        f.write(b"\0" * 16)
    store = local_store(tiny, root, max_adapter_bytes=size)

    async def main():
        assert "outside the configured adapter roots" in await refusal(store, "linked")
        assert "adapter_model.bin is" in await refusal(store, "big")
        assert (await store.resolve("plain")).rank == 8

    asyncio.run(main())


def test_hf_cache_adapters_resolve_by_org_and_name(tiny, root, tmp_path, local_ray):
    cache = tmp_path / "hub"
    fake_hf_cache(cache, "acme/support", tiny.adapters["adapter-01"])
    # a snapshot whose weights link out of the repo's folder
    bad = fake_hf_cache(cache, "acme/escape", tiny.adapters["adapter-00"])
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny.adapters["adapter-00"] / "adapter_model.safetensors", outside)
    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_model.safetensors").symlink_to(outside)
    store = make_store(tiny, root, resolvers=[LocalDirResolver([root]), HFCacheResolver(cache)])

    async def main():
        info = await store.resolve("acme/support")
        assert (info.name, info.rank, info.source) == ("acme/support", 16, "hf_cache")
        with pytest.raises(NotFoundError, match="outside the configured adapter roots"):
            await store.resolve("acme/escape")
        with pytest.raises(NotFoundError, match="local: not a directory name.*hf_cache: not in"):
            await store.resolve("acme/absent")
        assert (await store.resolve("adapter-00")).source == "local"  # the local one first

    asyncio.run(main())
    assert [i.name for i in listed(store)] == ["acme/support", "adapter-00"]


def test_a_tenants_loads_are_confined_to_its_own_roots(tiny, root, local_ray):
    """A tenant managing adapters loads only from its roots: another tenant's directory
    under the shared adapter roots is refused, and so is a tenant root outside them."""
    for tenant in ("acme", "globex"):
        shutil.copytree(tiny.adapters["adapter-00"], root / tenant / "mine")
    store = make_store(tiny, root)
    acme = [str(root / "acme")]

    async def main():
        assert (await store.register("acme-1", str(root / "acme" / "mine"), roots=acme)).version
        with pytest.raises(BadRequestError, match="outside the configured adapter roots"):
            await store.register("acme-2", str(root / "globex" / "mine"), roots=acme)
        with pytest.raises(BadRequestError, match="is outside adapter_roots"):
            await store.register("acme-3", str(root / "acme" / "mine"), roots=["/tmp"])

    asyncio.run(main())
    assert [i.name for i in listed(store)] == ["acme-1"]


def test_without_resolvers_an_unknown_name_is_just_not_registered(tiny, root, local_ray):
    store = make_store(tiny, root)
    with pytest.raises(NotFoundError, match="'adapter-00' is not registered$"):
        asyncio.run(store.resolve("adapter-00"))


# -- checkpoint: one entry per adapter --------------------------------------------------------


def test_each_change_writes_its_own_entry_only(tiny, root, checkpoint, monkeypatch):
    store = local_store(tiny, root, checkpoint=True)
    writes = Writes(monkeypatch)
    path = str(root / "adapter-00")

    async def main():
        for i in range(20):
            await store.register(f"a-{i}", path)
        # one entry each: the versions were reserved in a block when the store started
        assert writes.done == [("put", f"a-{i}") for i in range(20)]
        start = len(writes.done)
        await store.register("one-more", path)
        assert writes.done[start:] == [("put", "one-more")]
        start = len(writes.done)
        await store.unregister("a-3")
        assert writes.done[start:] == [("delete", "a-3")]
        start = len(writes.done)
        await store.register("a-4", str(root / "adapter-01"), inplace=True)
        assert writes.done[start:] == [("put", "a-4")]

    asyncio.run(main())
    entries = saved(checkpoint)
    assert entries["a-4"].path == str((root / "adapter-01").resolve())
    assert "a-3" not in entries and len(entries) == 20
    assert run(store.stats())["num_checkpoint_writes"] == 23


def test_a_restarted_store_restores_the_registry_with_the_same_versions(tiny, root, checkpoint):
    preload = {"pre": str(tiny.adapters["adapter-02"])}
    store = local_store(tiny, root, checkpoint=True, preload=preload)
    shutil.copytree(root / "adapter-01", root / "other")

    async def main():
        await store.register("loaded", str(root / "adapter-00"))
        await store.register("gone", str(root / "adapter-00"))
        await store.resolve("adapter-01")
        await store.unregister("gone")
        await store.register("loaded", str(root / "other"), inplace=True)
        assert (await store.register("last", str(root / "adapter-00"))).version == 6
        await store.unregister("last")

    asyncio.run(main())
    before = listed(store)
    again = local_store(tiny, root, checkpoint=True, preload=preload)
    assert listed(again) == before  # versions, paths, sources, ranks, modules, bytes
    assert {i.name for i in before} == {"pre", "loaded", "adapter-01"}
    assert again.registry.num_restored == 3 and again.registry.num_puts == 0  # no file read
    # no version is handed out twice
    assert again.registry._peek_version() >= store.registry._peek_version()

    # each is read and put once, on its first fetch, however many replicas ask at once
    loaded = next(i for i in before if i.name == "loaded")

    async def fetch_all():
        return await asyncio.gather(*(again.get_weights(loaded.key) for _ in range(5)))

    fetched = asyncio.run(fetch_all())
    assert again.registry.num_puts == 1 and {w.info for w in fetched} == {loaded}
    assert len({w.weights for w in fetched}) == 1 and ray.get(fetched[0].weights) is not None

    # versions unloaded before the restart are not handed out again either
    assert asyncio.run(again.register("new", str(root / "adapter-00"))).version > 6

    # an entry whose files no longer check out is dropped on first use, its entry too
    shutil.rmtree(root / "adapter-01")
    third = local_store(tiny, root, checkpoint=True, preload=preload)
    gone = next(i for i in listed(third) if i.name == "adapter-01")
    epoch = run(third.report_replica("r1", {})).epoch
    with pytest.raises(NotFoundError, match="no longer check out"):
        run(third.get_weights(gone.key))
    # a replica that kept its copy from before the restart is told to drop it
    assert run(third.report_replica("r1", {}, epoch)).removed == (gone.key,)
    assert {i.name for i in listed(third)} == {"pre", "loaded", "new"}
    assert set(saved(checkpoint)) == {"loaded", "new", "pre"}
    with pytest.raises(NotFoundError):
        run(third.resolve("adapter-01"))  # its resolver no longer finds it either


def test_a_checkpoint_actor_lost_while_the_store_lives_is_written_again_whole(
    tiny, root, checkpoint
):
    """Its node died, say: the next change makes a new one and gives it the whole
    registry, so a restart after that still finds every adapter."""
    store = local_store(tiny, root, checkpoint=True)
    path = str(root / "adapter-00")
    for name in ("a", "b"):
        asyncio.run(store.register(name, path))
    ray.kill(ray.get_actor(checkpoint, namespace=NAMESPACE))
    asyncio.run(store.register("c", path))
    assert set(saved(checkpoint)) == {"a", "b", "c"}
    again = local_store(tiny, root, checkpoint=True)
    assert listed(again) == listed(store)


def test_a_checkpoint_in_fields_this_version_does_not_read_is_started_afresh(
    tiny, root, checkpoint
):
    """The checkpoint actor outlives redeploys: one written by a lorafleet whose records
    had other fields is replaced, not misread."""
    store = local_store(tiny, root, checkpoint=True)
    asyncio.run(store.register("loaded", str(root / "adapter-00")))
    keeper = ray.get_actor(checkpoint, namespace=NAMESPACE)
    old = {"meta": {"preload": {}, "next": 7}, "adapters": {"loaded": {"name": "loaded"}}}
    ray.get(keeper.replace.remote(old))
    again = local_store(tiny, root, checkpoint=True)
    assert listed(again) == () and again.registry.num_restored == 0
    assert saved(checkpoint) == {}  # in this version's fields now


def test_a_checkpoint_of_another_preload_list_is_dropped(tiny, root, checkpoint):
    store = local_store(tiny, root, checkpoint=True)
    asyncio.run(store.register("loaded", str(root / "adapter-00")))
    preload = {"pre": str(tiny.adapters["adapter-02"])}
    other = local_store(tiny, root, checkpoint=True, preload=preload)
    assert [i.name for i in listed(other)] == ["pre"] and other.registry.num_restored == 0
    assert set(saved(checkpoint)) == {"pre"}


def test_a_resolved_hub_adapter_is_restored_only_while_its_resolver_finds_it(
    tiny, root, tmp_path, checkpoint
):
    cache = tmp_path / "hub"
    fake_hf_cache(cache, "acme/support", tiny.adapters["adapter-01"])
    resolvers = [HFCacheResolver(cache)]
    store = make_store(tiny, root, checkpoint=True, resolvers=resolvers)
    version = asyncio.run(store.resolve("acme/support")).version
    again = make_store(tiny, root, checkpoint=True, resolvers=resolvers)
    assert [(i.name, i.version) for i in listed(again)] == [("acme/support", version)]
    without = make_store(tiny, root, checkpoint=True)
    assert listed(without) == ()


# -- replica reports carry changes ----------------------------------------------------------


def test_replica_reports_carry_only_what_was_removed_since_the_last(tiny, root, local_ray):
    store = make_store(tiny, root)
    path = str(root / "adapter-00")
    b2, c3 = AdapterKey("b", 2), AdapterKey("c", 3)

    async def main():
        for name in ("a", "b", "c"):
            await store.register(name, path)
        first = await store.report_replica("r1", {})
        assert first.live == {"a": 1, "b": 2, "c": 3} and first.removed == ()
        quiet = await store.report_replica("r1", {}, first.epoch)
        assert quiet.live is None and quiet.removed == ()
        await store.unregister("b")
        await store.register("c", str(root / "adapter-01"), inplace=True)
        await store.register("d", path)  # a new name: nothing a replica must drop
        changed = await store.report_replica("r1", {}, quiet.epoch)
        assert changed.live is None and changed.removed == (b2, c3)
        assert (await store.report_replica("r1", {}, changed.epoch)).removed == ()
        # another store's epoch (a restart): the whole map, and what is still fetchable
        other = await store.report_replica("r1", {}, RegistryEpoch("another-incarnation", 1))
        assert other.live == {"a": 1, "c": 4, "d": 5} and other.removed == (b2, c3)
        assert set(await store.replica_stats()) == {"r1"}

    asyncio.run(main())


def test_a_replica_behind_the_change_log_gets_the_whole_map(tiny, root, local_ray, monkeypatch):
    monkeypatch.setattr(reports, "CHANGE_LOG_LEN", 4)
    store = make_store(tiny, root)
    path = str(root / "adapter-00")

    async def main():
        epoch = (await store.report_replica("r1", {})).epoch
        for i in range(6):
            await store.register(f"n{i}", path)
            await store.unregister(f"n{i}")
        behind = await store.report_replica("r1", {}, epoch)
        assert behind.live == {}
        assert (await store.report_replica("r1", {}, behind.epoch)).removed == ()

    asyncio.run(main())


# -- thousands of adapters ---------------------------------------------------------------------

NUM_MANY = 4096
# The registrations measured under tracemalloc: the last ones. Tracing doubles the time of
# what it traces (all 4,096 took ~45 s here, this ~30 s), and the first registrations carry
# one-time costs that are not the store's per adapter (~5 MB of modules imported on first
# use). Blocks allocated before tracing and freed during it are not subtracted: a resize of
# the registry's dicts in the window counts its new table whole (conservative).
NUM_TRACED = 1024


def test_a_registry_of_4096_adapters_costs_the_same_per_change(tiny, root, checkpoint, monkeypatch):
    """A change writes one checkpoint entry and a replica's report carries that change
    alone, with 4,096 adapters registered; the store's own memory grows by under 4 KiB per
    adapter registered (the weights live in the object store: measured over the last
    1,024, 3,072 already there), the listing moves only when the registry changed, and a
    restarted store lists them all without reading an adapter file."""
    store = local_store(tiny, root, checkpoint=True)
    path = str(tiny.adapters["adapter-02"])  # the smallest: q and v only
    store.registry.roots.roots.append(Path(path).parent.resolve())

    async def register(first: int, stop: int):
        for i in range(first, stop):
            await store.register(f"many-{i:05d}", path)

    asyncio.run(register(0, NUM_MANY - NUM_TRACED))
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        asyncio.run(register(NUM_MANY - NUM_TRACED, NUM_MANY))
        per_adapter = (tracemalloc.get_traced_memory()[0] - baseline) / NUM_TRACED
    finally:
        tracemalloc.stop()
    assert per_adapter < 4096, f"{per_adapter:.0f} bytes of store memory per adapter"
    assert run(store.stats())["num_adapters"] == NUM_MANY

    epoch = run(store.report_replica("r1", {})).epoch
    writes = Writes(monkeypatch)
    written = writes.during(lambda: asyncio.run(store.unregister("many-00007")))
    assert written == [("delete", "many-00007")]
    written = writes.during(
        lambda: asyncio.run(store.register("many-00008", str(root / "adapter-01"), inplace=True))
    )
    put = ("put", "many-00008")
    assert written in ([put], [("put_meta", "meta"), put])  # meta once per 1,024 versions

    report = run(store.report_replica("r1", {}, epoch))
    # versions count from 1: many-i is version i + 1
    assert report.live is None
    assert report.removed == (AdapterKey("many-00007", 8), AdapterKey("many-00008", 9))
    assert len(pickle.dumps(report)) < 1024

    # the listing is sorted once per change; a caller holding the current tag gets no list
    listing = run(store.listing())
    assert len(listing.adapters) == NUM_MANY - 1
    assert run(store.listing()).adapters is listing.adapters
    assert run(store.listing(listing.tag)).adapters is None
    asyncio.run(store.unregister("many-00009"))
    shorter = run(store.listing(listing.tag))
    assert shorter.tag != listing.tag and len(shorter.adapters) == NUM_MANY - 2

    assert len(saved(checkpoint)) == NUM_MANY - 2  # what a restart reads back
    restarted = local_store(tiny, root, checkpoint=True)  # lists them all, reads no file
    assert restarted.registry.num_restored == NUM_MANY - 2 and restarted.registry.num_puts == 0
    assert listed(restarted) == listed(store)

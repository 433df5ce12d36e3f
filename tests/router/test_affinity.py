"""The affinity ranking as a pure function: residency first, then HRW home, under a load bound."""

from __future__ import annotations

import collections

from replica.wire import AdapterKey, GenerateRequest, SamplingParams
from router.affinity import (
    PlacementMemory,
    ReplicaView,
    break_load_ties,
    hrw_order,
    prefix_key,
    rank_for_adapter,
    rank_for_prefix,
    routing_reason,
)

IDS = [f"r{i}" for i in range(4)]


def views(loads=(0, 0, 0, 0), device=None, host=None, free=None) -> list[ReplicaView]:
    device, host, free = device or {}, host or {}, free or {}
    return [
        ReplicaView(
            rid,
            load,
            frozenset(device.get(rid, ())),
            frozenset(host.get(rid, ())),
            free.get(rid, 0),
        )
        for rid, load in zip(IDS, loads)
    ]


def test_device_resident_first_then_host_then_hash_home() -> None:
    ranks = rank_for_adapter("a", views(device={"r2": {"a"}}, host={"r1": {"a"}}), 0.25)
    assert ranks[0] == ["r2"]
    assert ranks[1] == ["r1"]
    rest = [rid for rid in hrw_order("a", IDS) if rid not in ("r1", "r2")]
    assert ranks[2:4] == [[rid] for rid in rest]  # then the others, home first
    assert sorted(ranks[-1]) == IDS  # the last rank always holds every replica


def test_hash_home_is_stable_and_spreads_adapters() -> None:
    homes = [rank_for_adapter(f"ad{i}", views(), 0.25)[0][0] for i in range(400)]
    again = [rank_for_adapter(f"ad{i}", views(), 0.25)[0][0] for i in range(400)]
    assert homes == again
    counts = collections.Counter(homes)
    assert set(counts) == set(IDS) and min(counts.values()) > 60


def test_removing_a_replica_moves_only_its_adapters() -> None:
    before = {f"ad{i}": hrw_order(f"ad{i}", IDS)[0] for i in range(400)}
    after = {f"ad{i}": hrw_order(f"ad{i}", IDS[:3])[0] for i in range(400)}
    moved = [a for a in before if before[a] != after[a]]
    assert moved and all(before[a] == "r3" for a in moved)


def test_overloaded_resident_replica_spills_to_the_next_choice() -> None:
    # r0 holds the adapter but has 10 queued against a mean of 2.5: over the bound
    ranks = rank_for_adapter("a", views(loads=(10, 0, 0, 0), device={"r0": {"a"}}), 0.25)
    assert "r0" not in ranks[0] and all("r0" not in r for r in ranks[:-1])
    assert ranks[0][0] != "r0"


def test_short_queues_stay_with_the_adapter() -> None:
    # without a floor one request in flight already spills; the floor keeps affinity
    spread = views(loads=(1, 0, 0, 0), device={"r0": {"a"}})
    assert "r0" not in rank_for_adapter("a", spread, 0.25)[0]
    assert rank_for_adapter("a", spread, 0.25, floor=4)[0] == ["r0"]
    busy = views(loads=(4, 0, 0, 0), device={"r0": {"a"}})
    assert rank_for_adapter("a", busy, 0.25, floor=4)[0] != ["r0"]


def test_device_resident_replicas_share_by_load() -> None:
    """An adapter hot enough to have spilled is on two replicas' devices: both copies serve
    it, least loaded first (Serve picks within the rank), so neither has to be reloaded."""
    ranks = rank_for_adapter(
        "a", views(loads=(2, 1, 0, 0), device={"r0": {"a"}, "r1": {"a"}}), 0.25, 4
    )
    assert ranks[0] == ["r1", "r0"]


def test_host_resident_replicas_follow_the_hash_order() -> None:
    """Host caches are large, so after a while every replica holds most adapters there:
    those must not scatter an adapter's requests over all of them."""
    everywhere = views(host={r: {"a"} for r in IDS})
    assert [rank[0] for rank in rank_for_adapter("a", everywhere, 0.25)[:4]] == hrw_order("a", IDS)


def test_a_free_slot_beats_the_hash_home() -> None:
    """A home whose slots are all taken would evict a resident adapter; a replica with a
    free slot takes the new adapter at no such cost (homes are uneven: HRW splits 32
    adapters 19/13 as easily as 16/16)."""
    home, second, third, _ = hrw_order("a", IDS)
    ranks = rank_for_adapter("a", views(free={third: 2}), 0.25)
    assert ranks[:3] == [[third], [home], [second]]
    # with no free slot anywhere, the hash order stands
    assert [r[0] for r in rank_for_adapter("a", views(), 0.25)[:4]] == hrw_order("a", IDS)


def test_placement_memory_bridges_stale_stats() -> None:
    memory = PlacementMemory(memory_s=2.0)
    stale = ReplicaView("r0", 0, frozenset({"b"}), frozenset(), free_slots=2)
    memory.record("r0", "a", now=10.0)
    memory.record("r0", "b", now=10.0)  # already resident: takes no free slot
    seen = memory.view(stale, now=11.0)
    assert seen.device_adapters == {"a", "b"} and seen.free_slots == 1
    # a second request for "a" now goes where the first went, not to its hash home
    other = ReplicaView("r1", 0, free_slots=2)
    assert rank_for_adapter("a", [seen, other], 0.25, 4)[0] == ["r0"]
    # after memory_s the stats speak alone; a replica that died is forgotten
    assert memory.view(stale, now=12.5) == stale
    memory.record("r0", "c", now=20.0)
    memory.forget("r0")
    assert memory.view(stale, now=20.5) == stale


def test_routing_reasons() -> None:
    """The first choice is named by what made it first; anything else is a spill, whatever
    the replica it went to holds (the load bound sent it there)."""
    home, other = hrw_order("a", IDS)[:2]
    state = views(device={"r0": {"a"}}, host={"r1": {"a"}}, free={"r2": 1})
    assert routing_reason(None, state, "r3") == "base"
    assert routing_reason("a", state, "r0") == "device"
    assert routing_reason("a", state, "r1") == "spill"  # r0 held it in a slot
    assert routing_reason("a", views(host={"r1": {"a"}}), "r1") == "host"
    no_device = views(host={"r1": {"a"}}, free={"r2": 1})  # a free slot ranks first
    assert routing_reason("a", no_device, "r2") == "free_slot"
    assert routing_reason("a", no_device, "r1") == "spill"
    plain = views()
    assert routing_reason("a", plain, home) == "home"
    assert routing_reason("a", plain, other) == "spill"
    assert routing_reason("a", [], "r0") == "spill"  # nothing was known of it
    # what the router does past the load bound is what the reason calls a spill
    busy = views(loads=(9, 0, 0, 0), device={"r0": {"a"}})
    [first, *_] = rank_for_adapter("a", busy, 0.25, 4)
    assert "r0" not in first and routing_reason("a", busy, first[0]) == "spill"


def test_no_replicas() -> None:
    assert rank_for_adapter("a", [], 0.25) == []


def request(
    prompt: list[int], adapter: str | None = None, version: int = 1, **tenancy
) -> GenerateRequest:
    key = None if adapter is None else AdapterKey(adapter, version)
    return GenerateRequest(prompt, SamplingParams(), key, "r", **tenancy)


def test_prefix_keys_name_the_model_and_the_first_tokens() -> None:
    head = list(range(3, 19))
    key = prefix_key(request(head + [40, 41]), 16)
    assert key == prefix_key(request(head + [50]), 16)  # the rest of the prompt is not in it
    assert key != prefix_key(request([4, *head[1:], 40]), 16)
    assert key != prefix_key(request(head, "a"), 16) != prefix_key(request(head, "a", 2), 16)
    assert prefix_key(request(head[:15]), 16) is None  # too short to share a cached block
    assert prefix_key(request(head), 0) is None  # prefix affinity off


def test_base_requests_sharing_a_prefix_go_to_its_home_within_the_bound() -> None:
    keys = [prefix_key(request([i, *range(3, 18)]), 16) for i in range(200)]
    homes = [rank_for_prefix(k, views(), 0.25)[0] for k in keys]
    assert homes == [rank_for_prefix(k, views(), 0.25)[0] for k in keys]  # stable
    assert min(collections.Counter(h[0] for h in homes).values()) > 25  # prefixes spread
    key = keys[0]
    home = hrw_order(key, IDS)[0]
    ranks = rank_for_prefix(key, views(), 0.25, 4)
    assert [r[0] for r in ranks[:4]] == hrw_order(key, IDS) and sorted(ranks[-1]) == IDS
    busy = views(loads=tuple(9 if rid == home else 0 for rid in IDS))
    assert home not in rank_for_prefix(key, busy, 0.25, 4)[0]  # past the bound: the next


def test_a_hot_adapter_on_several_replicas_keeps_each_prefix_on_one() -> None:
    state = views(loads=(2, 1, 0, 0), device={"r0": {"a"}, "r1": {"a"}})
    keys = [prefix_key(request([i, *range(3, 18)], "a"), 16) for i in range(40)]
    firsts = {rank_for_adapter("a", state, 0.25, 4, k)[0][0] for k in keys}
    assert firsts == {"r0", "r1"}  # prefixes split over the holders, not by load
    for k in keys:
        ranks = rank_for_adapter("a", state, 0.25, 4, k)
        assert ranks[:2] == [[r] for r in hrw_order(k, ["r1", "r0"])]


def test_prefix_keys_carry_the_tenant_and_salt_as_the_prefix_cache_does() -> None:
    import hashlib

    head = list(range(3, 19))
    untenanted = prefix_key(request(head), 16)  # the key before tenants existed
    digest = hashlib.blake2b(f"\0{head}".encode(), digest_size=8).hexdigest()
    assert untenanted == "prefix:" + digest
    keys = {
        prefix_key(request(head, tenant=t, cache_salt=s), 16)
        for t, s in [(None, None), ("a", None), ("b", None), ("a", "x"), (None, "a")]
    }
    assert len(keys) == 5
    assert prefix_key(request(head, tenant="a"), 16) == prefix_key(request(head, tenant="a"), 16)


def test_load_ties_break_toward_where_the_tenant_is_served_soonest() -> None:
    def lagging(loads, lag_of):  # lag_of: replica -> tenant a's lag there
        return [
            ReplicaView(rid, load, tenant_lag={"a": lag_of[rid]} if rid in lag_of else {})
            for rid, load in zip(IDS, loads)
        ]

    state = lagging((1, 1, 1, 3), {"r0": 50.0, "r1": 10.0})
    assert break_load_ties([IDS], state, "a") == [["r2"], ["r0", "r1", "r3"]]
    # only ties on load are broken: a less loaded replica stays ahead whatever the lag
    state = lagging((0, 1, 1, 1), {"r0": 50.0})
    assert break_load_ties([IDS], state, "a") == [IDS]
    # another tenant's lag, or none published (FCFS replicas): the ranks unchanged
    assert break_load_ties([IDS, ["r1"]], state, "b") == [IDS, ["r1"]]
    assert break_load_ties([IDS], views(), "a") == [IDS]
    # single-replica ranks (affinity's preferences) are never reordered
    assert break_load_ties([["r0"], ["r2"]], lagging((1, 1, 1, 1), {"r0": 9.0}), "a") == [
        ["r0"],
        ["r2"],
    ]

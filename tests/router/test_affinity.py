"""The affinity ranking as a pure function: residency first, then HRW home, under a load bound."""

from __future__ import annotations

import collections

from router.affinity import ReplicaView, hrw_order, rank_for_adapter

IDS = [f"r{i}" for i in range(4)]


def views(loads=(0, 0, 0, 0), device=None, host=None) -> list[ReplicaView]:
    device, host = device or {}, host or {}
    return [
        ReplicaView(rid, load, frozenset(device.get(rid, ())), frozenset(host.get(rid, ())))
        for rid, load in zip(IDS, loads)
    ]


def test_device_resident_first_then_host_then_hash_home() -> None:
    ranks = rank_for_adapter("a", views(device={"r2": {"a"}}, host={"r1": {"a"}}), 0.25)
    assert ranks[0] == ["r2"]
    assert ranks[1] == ["r1"]
    assert ranks[2] == [hrw_order("a", IDS)[0]]
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


def test_resident_ranks_order_by_load() -> None:
    ranks = rank_for_adapter(
        "a", views(loads=(2, 1, 0, 0), device={"r0": {"a"}, "r1": {"a"}}), 0.25, 4
    )
    assert ranks[0] == ["r1", "r0"]


def test_no_replicas() -> None:
    assert rank_for_adapter("a", [], 0.25) == []

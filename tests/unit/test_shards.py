"""Shard assignment: rendezvous hashing with a load cap and sticky owners."""

from __future__ import annotations

import random
import statistics
import uuid
from collections import Counter

import pytest

from services.runtime.domain.shards import (
    DEFAULT_SHARD_COUNT,
    Moves,
    capacity,
    moves_for,
    shard_of,
    target_owners,
)

SHARDS = DEFAULT_SHARD_COUNT


def loads(assignment: dict[int, str]) -> Counter[str]:
    return Counter(assignment.values())


def test_a_workspace_always_lands_on_the_same_shard_and_workspaces_spread() -> None:
    workspace = uuid.UUID("0195f0c8-0000-7000-8000-000000000001")
    assert shard_of(workspace) == shard_of(uuid.UUID(str(workspace)))
    rng = random.Random(5)
    counts = Counter(shard_of(uuid.UUID(int=rng.getrandbits(128))) for _ in range(100_000))
    assert set(counts) == set(range(SHARDS))
    # 100,000 workspaces over 1,024 shards: about 98 each.
    assert max(counts.values()) < 2 * statistics.mean(counts.values())


def test_from_nothing_every_shard_gets_one_owner_and_none_is_over_the_cap() -> None:
    replicas = ["runtime-a", "runtime-b", "runtime-c"]
    target = target_owners(SHARDS, replicas, {})
    assert sorted(target) == list(range(SHARDS))
    assert max(loads(target).values()) == capacity(SHARDS, 3) == 342


def test_every_replica_computes_the_same_target_whatever_order_it_reads() -> None:
    current = {shard: ["b", "a", "c"][shard % 3] for shard in range(0, SHARDS, 2)}
    one = target_owners(SHARDS, ["a", "b", "c"], current)
    two = target_owners(SHARDS, ["c", "a", "b"], dict(reversed(list(current.items()))))
    assert one == two


@pytest.mark.parametrize(
    "names", [("a", "b", "c", "d"), ("runtime-0", "runtime-1", "runtime-2", "runtime-3")]
)
def test_scaling_from_three_to_four_moves_a_quarter_and_balances(names: tuple[str, ...]) -> None:
    three = target_owners(SHARDS, names[:3], {})
    four = target_owners(SHARDS, names, three)
    moved = [shard for shard in range(SHARDS) if three[shard] != four[shard]]
    # The bounds: within 10% of a quarter, the most loaded at most 1.25x the mean.
    assert abs(len(moved) - SHARDS / 4) <= 0.1 * SHARDS / 4
    assert {four[shard] for shard in moved} == {names[3]}, "only the new replica gains"
    assert max(loads(four).values()) <= 1.25 * SHARDS / 4


def test_a_replica_that_goes_loses_only_its_own_shards() -> None:
    four = target_owners(SHARDS, ["a", "b", "c", "d"], {})
    current = {shard: owner for shard, owner in four.items() if owner != "d"}
    three = target_owners(SHARDS, ["a", "b", "c"], current)
    moved = {shard for shard in range(SHARDS) if four[shard] != three[shard]}
    assert moved == {shard for shard, owner in four.items() if owner == "d"}
    assert max(loads(three).values()) <= capacity(SHARDS, 3)


def test_a_looser_cap_lets_rendezvous_preference_win_within_it() -> None:
    target = target_owners(SHARDS, ["a", "b", "c"], {}, load_cap=1.25)
    assert max(loads(target).values()) <= capacity(SHARDS, 3, 1.25)
    assert capacity(SHARDS, 4, 1.0) == 256 and capacity(SHARDS, 3, 1.0) == 342
    with pytest.raises(ValueError):
        capacity(SHARDS, 3, 0.9)


def test_no_live_replica_means_no_owner() -> None:
    assert target_owners(SHARDS, [], {1: "gone"}) == {}


def test_a_round_takes_only_free_shards_and_releases_bounded() -> None:
    three = target_owners(16, ["a", "b", "c"], {})
    four = target_owners(16, ["a", "b", "c", "d"], three)
    # The new replica can take nothing while the old owners hold its shards.
    assert moves_for("d", four, three, max_moves=8) == Moves(take=(), release=())
    giving = moves_for("a", four, three, max_moves=1)
    assert giving.take == () and len(giving.release) <= 1
    assert all(four[shard] == "d" and three[shard] == "a" for shard in giving.release)
    # Once released, they are free and the new owner takes them.
    after = {shard: owner for shard, owner in three.items() if shard not in giving.release}
    assert moves_for("d", four, after, max_moves=8).take == giving.release


def test_rounds_converge_to_the_target_and_never_have_two_owners() -> None:
    replicas = ["a", "b", "c", "d"]
    held = target_owners(64, replicas[:3], {})
    for _ in range(100):
        target = target_owners(64, replicas, held)
        plans = {replica: moves_for(replica, target, held, max_moves=4) for replica in replicas}
        if not any(plan.take or plan.release for plan in plans.values()):
            break
        # Releases first, then takes (a take never finds a shard still held).
        for plan in plans.values():
            for shard in plan.release:
                del held[shard]
        for replica, plan in plans.items():
            for shard in plan.take:
                assert shard not in held
                held[shard] = replica
    assert held == target_owners(64, replicas, held)
    assert sorted(loads(held).values()) == [16, 16, 16, 16]


def test_free_shards_are_taken_in_one_round_whatever_the_bound() -> None:
    # A replica died (its leases expired) or the system starts: nobody runs
    # these agents, so their new owner takes them all at once.
    target = target_owners(SHARDS, ["a", "b"], {})
    mine = tuple(sorted(shard for shard, owner in target.items() if owner == "a"))
    assert moves_for("a", target, {}, max_moves=1) == Moves(take=mine, release=())

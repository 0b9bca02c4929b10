"""Which runtime replica owns which agents.

Agents are grouped into a fixed number of shards by workspace, so that a
workspace's agents (and the IM watch that wakes them) stay on one replica.
Each shard has one owner at a time, proven by a lease in the database (see
`services.runtime.adapters.leases`); this module decides, from what every
replica can read there, which replica *should* own each shard:

- Rendezvous hashing ranks the replicas for each shard (highest random
  weight), so every replica computes the same answer from the same view, with
  no coordinator.
- A load cap bounds how many shards one replica may hold: ceil(cap x shards /
  replicas). With the default cap of 1.0 no replica holds more than
  ceil(shards / replicas).
- A shard stays with its current owner while that owner is live and under the
  cap, so scaling moves only the shards that must move: from 3 to 4 replicas,
  a quarter of them; when a replica goes, only its own.

All functions are pure: the lease keeper feeds them the view it read.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass

DEFAULT_SHARD_COUNT = 1024


def shard_of(workspace_id: uuid.UUID, shard_count: int = DEFAULT_SHARD_COUNT) -> int:
    """The shard of a workspace's agents: a stable hash (the same in every
    process and Python version, unlike `hash`)."""
    digest = hashlib.blake2b(workspace_id.bytes, digest_size=8).digest()
    return int.from_bytes(digest, "big") % shard_count


def weight(shard: int, replica: str) -> int:
    """Rendezvous weight of `replica` for `shard`: the higher, the more the
    replica is preferred."""
    digest = hashlib.blake2b(f"{shard}/{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def capacity(shard_count: int, replica_count: int, load_cap: float = 1.0) -> int:
    """The most shards one replica may be assigned."""
    if replica_count <= 0:
        return 0
    if load_cap < 1.0:
        raise ValueError("load_cap must be at least 1.0")
    # A tiny epsilon keeps an exact quotient (1024 / 4 x 1.0) from rounding up
    # through floating point.
    return max(1, math.ceil(load_cap * shard_count / replica_count - 1e-9))


def target_owners(
    shard_count: int,
    replicas: Collection[str],
    current: Mapping[int, str],
    *,
    load_cap: float = 1.0,
) -> dict[int, str]:
    """The owner each shard should have.

    Args:
        shard_count: shards numbered 0 .. shard_count - 1.
        replicas: the live replicas.
        current: each shard's owner now, for shards whose lease is live (a
            shard with an expired lease or an owner that is not live is free).
        load_cap: a replica is assigned at most
            `capacity(shard_count, len(replicas), load_cap)` shards.

    Returns:
        An owner for every shard, or an empty mapping if no replica is live.
    """
    live = sorted(set(replicas))
    if not live:
        return {}
    cap = capacity(shard_count, len(live), load_cap)
    assigned: dict[int, str] = {}
    load = dict.fromkeys(live, 0)

    # 1. Owners keep what they have, up to the cap: the shards they prefer most.
    kept: dict[str, list[int]] = {replica: [] for replica in live}
    for shard, owner in current.items():
        if owner in kept and 0 <= shard < shard_count:
            kept[owner].append(shard)
    for replica, shards in kept.items():
        shards.sort(key=lambda shard: weight(shard, replica), reverse=True)
        for shard in shards[:cap]:
            assigned[shard] = replica
            load[replica] += 1

    # 2. The rest go, in shard order, to the most preferring replica with room.
    ranked_cache: dict[int, list[str]] = {}
    for shard in range(shard_count):
        if shard in assigned:
            continue
        ranked = ranked_cache.setdefault(
            shard, sorted(live, key=lambda replica: weight(shard, replica), reverse=True)
        )
        owner = next((replica for replica in ranked if load[replica] < cap), ranked[0])
        assigned[shard] = owner
        load[owner] += 1
    return assigned


@dataclass(frozen=True, slots=True)
class Moves:
    """What one replica does in one round: shards to take (free ones assigned
    to it, all of them) and shards to give up (held ones assigned to another
    live replica, a bounded number)."""

    take: tuple[int, ...]
    release: tuple[int, ...]


def moves_for(
    replica: str,
    target: Mapping[int, str],
    current: Mapping[int, str],
    *,
    max_moves: int,
) -> Moves:
    """The bounded next step of `replica` towards `target`.

    A replica takes only shards nobody holds (`current` lists live leases
    only), so a handoff is always a release by the old owner followed by a
    take by the new one, never two owners at once. Free shards are taken all
    in one round: nobody runs their agents (a replica died, or the system is
    starting), so waiting would only delay them. Releases move running
    agents: at most `max_moves` per round, lowest shard first.
    """
    take = sorted(shard for shard, owner in target.items() if owner == replica and shard not in current)
    release = sorted(
        shard
        for shard, owner in current.items()
        if owner == replica and target.get(shard, replica) != replica
    )
    return Moves(take=tuple(take), release=tuple(release[:max_moves]))

"""The runtime's settings for running beside other replicas: leases only on PostgreSQL with Redis."""

from __future__ import annotations

import pytest

from services.common.settings import ConfigError
from services.runtime.config import Settings

ON_POSTGRES = {"DATABASE_URL": "postgresql://x@h/db", "RUNTIME_SERVICE_SECRET": "aim_svc_x"}


def test_the_embedded_runtime_runs_every_agent_itself() -> None:
    assert Settings.from_env({"AGENTIM_DATA_DIR": "/tmp/agentim"}).leases is None
    # Redis alone changes nothing: SQLite is one process's.
    assert Settings.from_env({"AGENTIM_DATA_DIR": "/tmp/agentim", "REDIS_URL": "redis://h"}).leases is None
    assert Settings.from_env(ON_POSTGRES).leases is None


def test_postgresql_with_redis_makes_a_replica_among_others() -> None:
    first = Settings.from_env({**ON_POSTGRES, "REDIS_URL": "redis://:pw@h:6379/0"})
    second = Settings.from_env({**ON_POSTGRES, "REDIS_URL": "redis://:pw@h:6379/0"})
    assert first.leases is not None and second.leases is not None
    assert (first.leases.shard_count, first.leases.ttl_seconds, first.leases.renew_seconds) == (
        1024,
        10.0,
        2.0,
    )
    assert first.leases.replica != second.leases.replica, "each process is a replica of its own"
    assert "pw" not in repr(first)
    named = Settings.from_env(
        {
            **ON_POSTGRES,
            "REDIS_URL": "redis://h",
            "RUNTIME_REPLICA_ID": "runtime-0",
            "RUNTIME_SHARDS": "64",
            "RUNTIME_LEASE_TTL_SECONDS": "4",
            "RUNTIME_LEASE_RENEW_SECONDS": "1",
            "RUNTIME_LEASE_MARGIN_SECONDS": "1",
            "RUNTIME_ADVERTISED_ADDRESS": "10.0.0.7:50052",
        }
    )
    assert named.leases is not None
    assert (named.leases.replica, named.leases.shard_count, named.leases.address) == (
        "runtime-0",
        64,
        "10.0.0.7:50052",
    )


def test_a_renewal_that_cannot_come_in_time_is_refused_with_the_rest() -> None:
    with pytest.raises(ConfigError) as error:
        Settings.from_env(
            {
                **ON_POSTGRES,
                "REDIS_URL": "redis://h",
                "RUNTIME_LEASE_TTL_SECONDS": "3",
                "RUNTIME_LEASE_RENEW_SECONDS": "2",
                "RUNTIME_SHARDS": "0",
            }
        )
    problems = "\n".join(error.value.problems)
    assert "RUNTIME_LEASE_" in problems and "RUNTIME_SHARDS" in problems

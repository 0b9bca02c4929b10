"""Token buckets and the RetryInfo of a refusal (services.common.ratelimit)."""

from __future__ import annotations

import pytest

from services.common.ratelimit import (
    Rate,
    RateLimits,
    TokenBuckets,
    read_rate_limits,
    retry_after_seconds,
)
from services.common.settings import ConfigError, EnvReader


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_lets_a_burst_through_then_refills_at_its_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(clock=clock)
    rate = Rate(per_second=2.0, burst=3)
    assert [buckets.take("ada send", rate) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("ada send", rate) == pytest.approx(0.5)  # one token in half a second
    assert buckets.take("bea send", rate) == 0.0  # each member has a bucket of its own
    clock.now += 0.5
    assert buckets.take("ada send", rate) == 0.0
    clock.now += 10  # never more than the burst
    assert [buckets.take("ada send", rate) for _ in range(4)][-1] > 0


def test_a_zero_rate_is_no_limit_and_forgotten_buckets_start_full() -> None:
    clock = Clock()
    buckets = TokenBuckets(max_keys=2, clock=clock)
    assert all(buckets.take("ada", Rate(0.0, 1)) == 0.0 for _ in range(1000))
    tight = Rate(per_second=0.001, burst=1)
    assert buckets.take("ada", tight) == 0.0 and buckets.take("ada", tight) > 0
    buckets.take("bea", tight)
    buckets.take("cai", tight)  # ada's bucket is the least recently used: dropped
    assert buckets.take("ada", tight) == 0.0


def test_no_retry_delay_is_read_where_none_was_sent() -> None:
    assert retry_after_seconds([("other", "x")]) is None and retry_after_seconds(None) is None


def test_rates_come_from_the_environment_with_every_problem_named() -> None:
    assert read_rate_limits(EnvReader({})) == RateLimits()
    limits = read_rate_limits(EnvReader({"LIMIT_SEND_PER_SECOND": "0", "LIMIT_CREATE_BURST": "7"}))
    assert not limits.send.limited and limits.create.burst == 7
    env = EnvReader({"LIMIT_SEND_PER_SECOND": "fast", "LIMIT_CREATE_BURST": "0"})
    read_rate_limits(env)
    with pytest.raises(ConfigError) as failed:
        env.finish()
    assert "LIMIT_SEND_PER_SECOND" in str(failed.value) and "LIMIT_CREATE_BURST" in str(failed.value)

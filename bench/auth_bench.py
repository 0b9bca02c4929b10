"""What verifying access tokens costs `SendMessage` (issue 11).

One IM server (a subprocess on SQLite, as `bench.im_bench` runs it) and the
32 senders of `bench.im_bench` (`bench.calls.setup_senders`); each run
measures SendMessage at 32 clients and at 1 client twice, interleaved: once as clients call, each sender with
its one access token (the IM verifies a token the first time it sees it and
then remembers it), and once with a token never seen before on every call,
so that every call is verified in full (an Ed25519 signature, issuer,
audience, expiry). The tokens are signed with the IM's own key, as
`AuthService` signs them, and every call's token is matched against its
member's workspace. Reported: medians over the runs, the ratio of the
throughputs at 32 clients and the added p50 at one client, and what
`Verifier.verify` costs in process.

Until issue 11 removed the `x-member-id` header, this compared tokens with
that header (trusted, nothing checked): docs/benchmarks.md keeps those
figures.

    .venv/bin/python -m bench.auth_bench [--runs 5] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import stats
from bench.calls import CALL_TIMEOUT_S, SEND_MEMBERS, Sender, setup_senders
from bench.harness import LoadSample, backend_on, closed_loop
from services.common.authn import AuthenticationInterceptor
from services.common.identity import bearer_metadata
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Verifier, keyring_source, sign
from services.im.entrypoints.policy import IM_POLICY
from tests.auth_support import auth_dir

# Calls a second that a pool of fresh tokens is sized for (more than this
# machine serves); a pool that runs out starts over, and says so.
POOL_CALLS_PER_SECOND = 2500
# Each sender its own worker.
CONCURRENCY = SEND_MEMBERS


@dataclass
class Figures:
    cached32: list[LoadSample]
    fresh32: list[LoadSample]
    cached1: list[LoadSample]
    fresh1: list[LoadSample]


class FreshTokens:
    """For each sender, tokens never sent before, one per call: the claims of
    the sender's token, each signed with a new token id. Signed ahead
    (signing is not what is measured), `calls` per sender."""

    def __init__(self, claims: list[AccessClaims], keys: KeyRing, calls: int) -> None:
        self.exhausted = False
        self._next = [0] * len(claims)
        self._tokens = [
            [
                bearer_metadata(sign(replace(c, issued_at=None, expires_at=None, token_id=""), keys))
                for _ in range(calls)
            ]
            for c in claims
        ]

    def sending(self, stub: Any, senders: list[Sender]) -> Callable[[int], Any]:
        """A closed loop's call: worker i sends as sender i, with its next token."""

        def call(i: int) -> Any:
            s = senders[i % len(senders)]
            return stub.SendMessage(s.request, metadata=self.take(i), timeout=CALL_TIMEOUT_S)

        return call

    def take(self, index: int) -> tuple[tuple[str, str], ...]:
        tokens = self._tokens[index]
        position = self._next[index]
        if position >= len(tokens):
            self.exhausted = True
        self._next[index] = position + 1
        return tokens[position % len(tokens)]


async def measure(runs: int, seconds: float, warmup: float) -> Figures:
    figures = Figures([], [], [], [])
    keys = KeyRing.load(auth_dir() / "keys")
    with tempfile.TemporaryDirectory(prefix="agentim-auth-bench-") as workdir:
        async with contextlib.AsyncExitStack() as stack:
            backend = await backend_on(stack, "sqlite", workdir=Path(workdir))
            await backend.migrate(runtime=False)
            server = await backend.start_im(stack, name="IM service", log_path=Path(workdir) / "im.log")
            stub: Any = backend.im_stub
            senders = await setup_senders(stub)
            verifier = Verifier(keyring_source(keys))
            claims = [await verifier.verify(s.metadata[0][1].removeprefix("Bearer ")) for s in senders]
            window = seconds + warmup

            def cached(i: int) -> Any:
                s = senders[i % len(senders)]
                return stub.SendMessage(s.request, metadata=s.metadata, timeout=CALL_TIMEOUT_S)

            async def run(call: Callable[[int], Any], concurrency: int) -> LoadSample:
                sample = await closed_loop(
                    call, concurrency=concurrency, seconds=seconds, warmup=warmup, server_pid=server.pid
                )
                if sample.errors:
                    raise SystemExit(f"calls failed: {dict(sample.errors)}")
                return sample

            for number in range(1, runs + 1):
                per_sender = math.ceil(POOL_CALLS_PER_SECOND * window / CONCURRENCY)
                pools = {
                    CONCURRENCY: FreshTokens(claims, keys, per_sender),
                    1: FreshTokens(claims[:1], keys, math.ceil(POOL_CALLS_PER_SECOND * window)),
                }

                # Interleaved (and the order flipped every run) so that both see the same noise.
                order = ["cached", "fresh"]
                for name in order if number % 2 else order[::-1]:
                    for concurrency in (CONCURRENCY, 1):
                        call = cached if name == "cached" else pools[concurrency].sending(stub, senders)
                        getattr(figures, f"{name}{concurrency}").append(await run(call, concurrency))
                if any(pool.exhausted for pool in pools.values()):
                    print("warning: a pool of fresh tokens ran out; some calls reused tokens", flush=True)
                print(
                    f"run {number}: SendMessage@32 cached {figures.cached32[-1].throughput:.0f}/s, "
                    f"fresh {figures.fresh32[-1].throughput:.0f}/s; @1 p50 cached "
                    f"{figures.cached1[-1].p(0.5):.3f} ms, fresh {figures.fresh1[-1].p(0.5):.3f} ms",
                    flush=True,
                )
    return figures


async def verify_cost(repeats: int = 2000) -> tuple[float, float]:
    """In-process microseconds per `Verifier.verify`: a new token each time, and the same one."""
    with tempfile.TemporaryDirectory(prefix="agentim-auth-bench-keys-") as directory:
        KeyRing.generate(Path(directory))
        ring = KeyRing.load(Path(directory))

        async def source() -> Any:
            return ring.jwks()

        def token() -> str:
            return sign(
                AccessClaims(kind=PrincipalKind.HUMAN, member_id=uuid.uuid4(), workspace_id=uuid.uuid4()),
                ring,
            )

        fresh = [token() for _ in range(repeats)]
        verifier = Verifier(source)
        await verifier.verify(fresh[0])
        started = time.perf_counter()
        for each in fresh:
            await verifier.verify(each)
        first_sight = (time.perf_counter() - started) / repeats * 1e6
        started = time.perf_counter()
        for _ in range(repeats):
            await verifier.verify(fresh[0])
        remembered = (time.perf_counter() - started) / repeats * 1e6
    return first_sight, remembered


async def authentication_cost(repeats: int = 20000) -> float:
    """In-process microseconds the IM's `AuthenticationInterceptor` adds to a
    SendMessage with a token seen before (the policy's rule, the bearer
    header, the remembered verification, the caller): median of 20 rounds."""
    with tempfile.TemporaryDirectory(prefix="agentim-auth-bench-keys-") as directory:
        KeyRing.generate(Path(directory))
        ring = KeyRing.load(Path(directory))

        async def source() -> Any:
            return ring.jwks()

        interceptor = AuthenticationInterceptor(IM_POLICY, Verifier(source))
        claims = AccessClaims(kind=PrincipalKind.HUMAN, member_id=uuid.uuid4(), workspace_id=uuid.uuid4())
        metadata = (("user-agent", "grpc-python/1.85.1"), *bearer_metadata(sign(claims, ring)))
        method = "/agentim.im.v1.IMService/SendMessage"
        await interceptor.authenticate(method, metadata)
        rounds = []
        for _ in range(20):
            started = time.perf_counter()
            for _ in range(repeats // 20):
                await interceptor.authenticate(method, metadata)
            rounds.append((time.perf_counter() - started) / (repeats // 20) * 1e6)
    return stats.median(rounds)


def report(figures: Figures, first_sight_us: float, remembered_us: float, per_call_us: float) -> str:
    def median(samples: list[LoadSample], what: str) -> float:
        if what == "throughput":
            return stats.median(s.throughput for s in samples)
        return stats.median(s.p(0.5) for s in samples)

    ratios = [f.throughput / c.throughput for f, c in zip(figures.fresh32, figures.cached32, strict=True)]
    added = [f.p(0.5) - c.p(0.5) for f, c in zip(figures.fresh1, figures.cached1, strict=True)]
    lines = [
        "| | a token seen before | a new token every call |",
        "|---|---:|---:|",
        f"| SendMessage@32, calls/s | {median(figures.cached32, 'throughput'):.0f} "
        f"| {median(figures.fresh32, 'throughput'):.0f} |",
        f"| SendMessage@32, p50 ms | {median(figures.cached32, 'p50'):.2f} "
        f"| {median(figures.fresh32, 'p50'):.2f} |",
        f"| SendMessage@1, p50 ms | {median(figures.cached1, 'p50'):.3f} "
        f"| {median(figures.fresh1, 'p50'):.3f} |",
        "",
        f"New-token/seen-token throughput at 32 clients, median of the per-run ratios: "
        f"{stats.median(ratios):.2f}; added p50 at 1 client, median of the per-run differences: "
        f"{stats.median(added):.3f} ms.",
        f"Verifier.verify in process: {first_sight_us:.0f} µs for a token seen the first time, "
        f"{remembered_us:.1f} µs for one seen before.",
        f"Authentication of a SendMessage in process (the interceptor, a token seen before): "
        f"{per_call_us:.1f} µs, {per_call_us / (1e6 / median(figures.cached32, 'throughput')) * 100:.2f}% "
        f"of the IM's time per call at 32 clients (so throughput without it would be at most "
        f"{1 / (1 - per_call_us / (1e6 / median(figures.cached32, 'throughput'))):.3f}x), and "
        f"{per_call_us / 1000:.4f} ms added to a call's latency.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="interleaved repetitions (medians)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per closed-loop run")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
    options = parser.parse_args(argv)
    figures = asyncio.run(measure(options.runs, options.seconds, options.warmup))
    first_sight, remembered = asyncio.run(verify_cost())
    print(report(figures, first_sight, remembered, asyncio.run(authentication_cost())))


if __name__ == "__main__":
    main()

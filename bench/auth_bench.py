"""What verifying access tokens costs `SendMessage` (issue 11).

One IM server (a subprocess on SQLite, as `bench.im_bench` runs it) and the
32 senders of `bench.im_bench`; each run measures SendMessage at 32 clients
and at 1 client twice, interleaved: once with the legacy `x-member-id`
header, which the server trusts without checking anything, and once with
`authorization: Bearer <access token>`, which it verifies (an Ed25519
signature, issuer, audience, expiry) and matches against the member's
workspace on every call. The tokens are signed with the IM's own key, as
`AuthService` signs them. Reported: medians over the runs, and the ratio of
token to header throughput (target: at least 0.9) and the added p50 at one
client (target: under 0.1 ms).

    .venv/bin/python -m bench.auth_bench [--runs 5] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from agentim.im.v1 import im_pb2, im_pb2_grpc
from bench.im_bench import (
    CALL_TIMEOUT_S,
    CONCURRENCY,
    MIGRATE_TIMEOUT_S,
    LoadSample,
    Sender,
    _server_env,
    closed_loop,
    run_command,
    running_server,
    setup_senders,
)
from services.common.identity import MEMBER_ID_KEY, bearer_metadata
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Verifier, sign

TARGET_RATIO = 0.9
TARGET_ADDED_P50_MS = 0.1


@dataclass
class Figures:
    header32: list[LoadSample]
    token32: list[LoadSample]
    header1: list[LoadSample]
    token1: list[LoadSample]


def with_tokens(senders: list[Sender], keys: KeyRing, workspace_id: str) -> list[Sender]:
    """The same senders, each with an access token for its member instead of the header."""
    tokened = []
    for sender in senders:
        (member,) = [value for key, value in sender.metadata if key == MEMBER_ID_KEY]
        claims = AccessClaims(
            kind=PrincipalKind.HUMAN,
            member_id=uuid.UUID(member),
            workspace_id=uuid.UUID(workspace_id),
            roles=("member",),
        )
        tokened.append(replace(sender, metadata=bearer_metadata(sign(claims, keys))))
    return tokened


async def measure(runs: int, seconds: float, warmup: float) -> Figures:
    figures = Figures([], [], [], [])
    with tempfile.TemporaryDirectory(prefix="agentim-auth-bench-") as workdir:
        data_dir = Path(workdir)
        env = _server_env(f"sqlite:///{data_dir / 'im.db'}", data_dir)
        python = sys.executable
        await run_command([python, "-m", "services.im", "migrate"], env=env, limit_s=MIGRATE_TIMEOUT_S)
        async with (
            running_server(
                "IM service", [python, "-m", "services.im", "serve"], env=env, log_path=data_dir / "im.log"
            ) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            stub: Any = im_pb2_grpc.IMServiceStub(channel)
            header_senders = await setup_senders(stub)
            first = header_senders[0]
            group = await stub.GetGroup(
                im_pb2.GetGroupRequest(group_id=first.request.group_id),
                metadata=first.metadata,
                timeout=CALL_TIMEOUT_S,
            )
            token_senders = with_tokens(
                header_senders, KeyRing.load(data_dir / "keys"), group.group.workspace_id
            )

            def sending(senders: list[Sender]) -> Any:
                async def send(i: int) -> object:
                    s = senders[i % len(senders)]
                    return await stub.SendMessage(s.request, metadata=s.metadata, timeout=CALL_TIMEOUT_S)

                return send

            async def run(senders: list[Sender], concurrency: int) -> LoadSample:
                sample = await closed_loop(
                    sending(senders),
                    concurrency=concurrency,
                    seconds=seconds,
                    warmup=warmup,
                    server_pid=server.pid,
                )
                if sample.errors:
                    raise SystemExit(f"calls failed: {dict(sample.errors)}")
                return sample

            for number in range(1, runs + 1):
                # Interleaved (and the order flipped every run) so that both see the same noise.
                order = [(header_senders, "header"), (token_senders, "token")]
                for senders, name in order if number % 2 else order[::-1]:
                    getattr(figures, f"{name}32").append(await run(senders, CONCURRENCY))
                    getattr(figures, f"{name}1").append(await run(senders, 1))
                print(
                    f"run {number}: SendMessage@32 header {figures.header32[-1].throughput:.0f}/s, "
                    f"token {figures.token32[-1].throughput:.0f}/s; @1 p50 header "
                    f"{figures.header1[-1].p(0.5):.3f} ms, token {figures.token1[-1].p(0.5):.3f} ms",
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


def report(figures: Figures, first_sight_us: float, remembered_us: float) -> str:
    def median(samples: list[LoadSample], what: str) -> float:
        if what == "throughput":
            return statistics.median(s.throughput for s in samples)
        return statistics.median(s.p(0.5) for s in samples)

    ratios = [t.throughput / h.throughput for t, h in zip(figures.token32, figures.header32, strict=True)]
    added = [t.p(0.5) - h.p(0.5) for t, h in zip(figures.token1, figures.header1, strict=True)]
    ratio = statistics.median(ratios)
    added_p50 = statistics.median(added)
    lines = [
        "| | x-member-id (trusted) | access token (verified) |",
        "|---|---:|---:|",
        f"| SendMessage@32, calls/s | {median(figures.header32, 'throughput'):.0f} "
        f"| {median(figures.token32, 'throughput'):.0f} |",
        f"| SendMessage@32, p50 ms | {median(figures.header32, 'p50'):.2f} "
        f"| {median(figures.token32, 'p50'):.2f} |",
        f"| SendMessage@1, p50 ms | {median(figures.header1, 'p50'):.3f} "
        f"| {median(figures.token1, 'p50'):.3f} |",
        "",
        f"Token/header throughput at 32 clients, median of the per-run ratios: {ratio:.2f} "
        f"(target ≥ {TARGET_RATIO}: {'met' if ratio >= TARGET_RATIO else 'not met'}); "
        f"added p50 at 1 client, median of the per-run differences: {added_p50:.3f} ms "
        f"(target < {TARGET_ADDED_P50_MS} ms: {'met' if added_p50 < TARGET_ADDED_P50_MS else 'not met'}); "
        f"difference of the medians: "
        f"{median(figures.token1, 'p50') - median(figures.header1, 'p50'):.3f} ms.",
        f"Verifier.verify in process: {first_sight_us:.0f} µs for a token seen the first time, "
        f"{remembered_us:.1f} µs for one seen before.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="interleaved repetitions (medians)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per closed-loop run")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
    options = parser.parse_args(argv)
    figures = asyncio.run(measure(options.runs, options.seconds, options.warmup))
    print(report(figures, *asyncio.run(verify_cost())))


if __name__ == "__main__":
    main()

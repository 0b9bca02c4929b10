"""A container health probe: `python -m services.common.healthcheck HOST:PORT`.

Calls the standard `grpc.health.v1.Health/Check` and exits 0 only when the
answer is SERVING, so that Docker (or any supervisor) can tell a server that
is up and ready from one that is starting, draining or cut off from its
database. It prints one line saying what it saw, for `docker inspect`.

Exit codes: 0 serving, 1 anything else (not serving, unknown service,
unreachable, timed out), 2 bad arguments. It speaks TLS (and shows the
service's certificate for mutual TLS) as the services do, from the same
`GRPC_TLS_*` settings (see `services.common.tls`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clients import make_channel
from services.common.settings import ConfigError, EnvReader
from services.common.tls import ClientTls, read_tls

EXIT_SERVING = 0
EXIT_UNHEALTHY = 1


async def check(
    target: str, *, service: str = "", deadline_seconds: float = 3.0, tls: ClientTls | None = None
) -> str:
    """Asks a server for its health.

    Args:
        target: host:port of the server.
        service: the service to ask about; empty for the server as a whole.
        deadline_seconds: deadline of the call.
        tls: call over TLS; None: plaintext.

    Returns:
        The name of the status (``SERVING``, ``NOT_SERVING``, ...).

    Raises:
        grpc.aio.AioRpcError: the call failed (unreachable, deadline
            exceeded, unknown service...).
    """
    async with make_channel(target, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=deadline_seconds)
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


def address_argument(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return value


def seconds_argument(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return number


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the probe; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck",
        description="Exit 0 if a gRPC server reports SERVING on grpc.health.v1.Health/Check.",
    )
    parser.add_argument("address", type=address_argument, help="HOST:PORT of the server")
    parser.add_argument(
        "--service", default="", help="service to check, e.g. agentim.im.v1.IMService (default: the server)"
    )
    parser.add_argument(
        "--timeout", type=seconds_argument, default=3.0, help="deadline in seconds (default: 3)"
    )
    options = parser.parse_args(argv)
    subject = options.service or "server"
    env = EnvReader()
    tls = read_tls(env)
    try:
        env.finish()
    except ConfigError as error:
        print(error, file=sys.stderr)
        return EXIT_UNHEALTHY
    try:
        status = asyncio.run(
            check(options.address, service=options.service, deadline_seconds=options.timeout, tls=tls.client)
        )
    except grpc.aio.AioRpcError as error:
        reason = ": ".join(part for part in (error.code().name, error.details()) if part)
        print(f"{subject} at {options.address}: {reason}", file=sys.stderr)
        return EXIT_UNHEALTHY
    print(f"{subject} at {options.address}: {status}")
    return EXIT_SERVING if status == "SERVING" else EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())

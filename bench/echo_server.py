"""A bare `grpc.aio` unary echo server: the ceiling the IM benchmark compares with.

It has no interceptor, no health service and no protobuf: a generic handler
returns the request bytes as they came. It uses the same server options as
`services.common.server.GrpcServer`, so the difference between its
throughput and a real service's is the cost of the service itself.

Run as `python -m bench.echo_server [--address 127.0.0.1:0]`; it prints one
line `echo server listening on HOST:PORT` and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

import grpc

SERVICE = "agentim.bench.v1.EchoService"
METHOD = f"/{SERVICE}/Echo"

_OPTIONS = [
    # As in GrpcServer: without this a second server silently shares the port.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 1024 * 1024),
    ("grpc.max_send_message_length", 1024 * 1024),
]


async def _echo(request: bytes, context: Any) -> bytes:
    return request


def build_server() -> Any:
    """An unstarted server with the echo method registered."""
    server = grpc.aio.server(options=_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    return server


async def serve(address: str) -> None:
    server = build_server()
    port = server.add_insecure_port(address)
    if port == 0:
        raise SystemExit(f"echo server cannot listen on {address}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    print(f"echo server listening on {address.rpartition(':')[0]}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.echo_server", description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:0", help="host:port; port 0 picks a free port")
    options = parser.parse_args(argv)
    asyncio.run(serve(options.address))


if __name__ == "__main__":
    main()

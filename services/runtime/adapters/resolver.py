"""Name resolution for the endpoint guard, through the event loop's resolver."""

from __future__ import annotations

import asyncio
import socket


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6).

    Raises:
        OSError: the name does not resolve.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})

"""Passwords hashed with argon2id (argon2-cffi), on threads of their own.

Hashing is slow on purpose (about 0.2 s and 64 MiB with the defaults, RFC
9106's second recommended profile): it runs on a small pool, never on the
event loop, and the pool's size bounds the memory it can take at once.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from services.im.service_layer.auth_ports import Passwords

T = TypeVar("T")


class Argon2Passwords(Passwords):
    """argon2id hashes in PHC string form (`$argon2id$v=19$m=...`).

    Args:
        memory_kib: memory per hash, in KiB.
        time_cost: passes over that memory.
        threads: hashes computed at once (each takes memory_kib).
    """

    def __init__(self, *, memory_kib: int = 65536, time_cost: int = 3, threads: int = 2) -> None:
        self._hasher = PasswordHasher(memory_cost=memory_kib, time_cost=time_cost)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="argon2")
        self._decoy: str | None = None

    async def _run(self, function: Callable[..., T], *args: str) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    async def hash(self, password: str) -> str:
        return await self._run(self._hasher.hash, password)

    async def verify(self, password_hash: str, password: str) -> bool:
        return await self._run(self._check, password_hash, password)

    def _check(self, password_hash: str, password: str) -> bool:
        try:
            return self._hasher.verify(password_hash, password)
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False

    async def waste_time(self, password: str) -> None:
        if self._decoy is None:
            self._decoy = await self.hash(secrets.token_urlsafe(16))
        await self.verify(self._decoy, password)

    async def aclose(self) -> None:
        """Lets running hashes finish; later calls fail. Idempotent."""
        self._pool.shutdown(wait=False)

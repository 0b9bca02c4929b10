"""Signals between replicas: the port, and its in-process implementation
(the default; `services.common.redis_signals` carries them across replicas).

A signal says only "key K has news up to N" (the IM: workspace W has events
up to sequence N; the runtime: agent A has work); receivers read what it is
about from the database, the only source of truth. Losing a signal delays
delivery, never loses anything: while Redis is away every receiver is told to
look at every key at a short interval, and after Redis comes back once more.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Callable

Receiver = Callable[[uuid.UUID | None, int], None]


class Signal(abc.ABC):
    """Tells every replica's receivers that a key has news.

    A signal carries no data that matters for correctness: the database is
    the only source of truth, and a lost signal only delays delivery.
    """

    @abc.abstractmethod
    async def publish(self, key: uuid.UUID, sequence: int) -> None: ...

    @abc.abstractmethod
    def connect(self, on_signal: Receiver) -> None:
        """Registers the receiver; a key of None means 'check every key'."""

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Starts listening (a no-op for in-process signalling)."""

    @property
    def degraded(self) -> bool:
        """Whether signals from other replicas cannot arrive now (delivery then
        falls back to reading the database at intervals). Never, in-process."""
        return False

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Stops listening and releases connections. Idempotent."""


class InProcessSignal(Signal):
    """Delivers signals to receivers in this process, synchronously."""

    def __init__(self) -> None:
        self._receivers: list[Receiver] = []

    def connect(self, on_signal: Receiver) -> None:
        self._receivers.append(on_signal)

    async def publish(self, key: uuid.UUID, sequence: int) -> None:
        self.deliver(key, sequence)

    def deliver(self, key: uuid.UUID | None, sequence: int) -> None:
        for receiver in self._receivers:
            receiver(key, sequence)

    async def publish_all(self) -> None:
        """Asks every receiver to look at every key."""
        self.deliver(None, 0)

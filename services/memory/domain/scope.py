"""Whose memory a request reads, for whom, and what narrows it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from services.memory.domain.model import SegmentType


@dataclass(frozen=True, slots=True)
class Scope:
    """One agent's memory (`agent_id` set) or a whole workspace's, seen by `audience`.

    In the agent scope an empty audience sees everything the agent keeps (the
    agent reading its own memory with nobody else to show it to); in the
    workspace scope the audience is the person searching.
    """

    workspace_id: str
    audience: frozenset[str]
    agent_id: str | None = None

    @property
    def agent_scope(self) -> bool:
        return self.agent_id is not None

    @property
    def cache_key(self) -> str:
        return f"agent:{self.agent_id}" if self.agent_id is not None else f"workspace:{self.workspace_id}"


def scopes_of(owners: Iterable[tuple[str, str]]) -> set[str]:
    """The cache keys (`Scope.cache_key`) of every scope that segments of
    these (agent, workspace) pairs are in: what a write to them makes stale."""
    return {key for agent, workspace in owners for key in (f"agent:{agent}", f"workspace:{workspace}")}


@dataclass(frozen=True, slots=True)
class Filters:
    types: frozenset[SegmentType] = frozenset()
    since: datetime | None = None
    until: datetime | None = None
    group_id: str = ""
    agent_id: str = ""
    exclude_run_ids: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class ForgetTarget:
    """What Forget deletes: exactly one of the ids, optionally only before a time."""

    run_id: str = ""
    session_id: str = ""
    agent_id: str = ""
    workspace_id: str = ""
    before: datetime | None = None

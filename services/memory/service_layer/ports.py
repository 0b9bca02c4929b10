"""What the memory service needs from the world: storage, an embedder, a member directory."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from services.memory.domain.lexicon import Lexicon
from services.memory.domain.model import (
    ArchivedRun,
    MemoryStats,
    Ref,
    RunInfo,
    SegmentDraft,
    StoredSegment,
)
from services.memory.domain.ranking import Hit
from services.memory.domain.scope import Filters, ForgetTarget, Scope

Vector = npt.NDArray[np.float32]


class Embedder(abc.ABC):
    """Turns text into unit vectors; e5-style models embed queries and passages differently."""

    name: str
    dimensions: int

    @abc.abstractmethod
    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """One unit vector per text, as rows."""

    @abc.abstractmethod
    async def embed_query(self, text: str) -> Vector: ...

    async def aclose(self) -> None:  # noqa: B027 - most embedders hold nothing
        """Releases what the embedder holds. Idempotent."""


@dataclass(frozen=True, slots=True)
class MemberInfo:
    member_id: str
    workspace_id: str
    is_agent: bool
    # An agent's owner (the person who made it); empty for a person.
    owner_id: str = ""


class MemberDirectory(abc.ABC):
    """Who a member is (the IM knows)."""

    @abc.abstractmethod
    async def member(self, member_id: str) -> MemberInfo | None:
        """The member, or None if the IM knows no such member.

        Raises:
            DirectoryUnavailable: the IM cannot be asked now.
        """

    async def aclose(self) -> None:  # noqa: B027
        """Closes the connection to the directory. Idempotent."""


class Dictionary(abc.ABC):
    """A bilingual dictionary for cross-language lexical search, which may
    still be loading."""

    @abc.abstractmethod
    def lexicon(self) -> Lexicon | None:
        """The dictionary, or None while it is not loaded (search then goes
        on without translations)."""

    def start(self) -> None:  # noqa: B027 - most dictionaries are there at once
        """Starts loading, if it takes a while."""

    async def aclose(self) -> None:  # noqa: B027
        """Stops loading. Idempotent."""


@dataclass(frozen=True, slots=True)
class PendingSegment:
    key: int
    text: str
    language: str


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    workspace_id: str
    agent_member_id: str


class MemoryStore(abc.ABC):
    """The segments, their indexes and their runs."""

    @abc.abstractmethod
    async def archive(self, run: ArchivedRun, drafts: Sequence[SegmentDraft], content_hash: str) -> bool:
        """Stores the run's segments in place of any earlier ones; False if it was stored as it is.

        Raises:
            NotAllowed: the run id belongs to another agent or workspace.
        """

    @abc.abstractmethod
    async def agent_identity(self, agent_id: str) -> AgentIdentity | None: ...

    @abc.abstractmethod
    async def run_info(self, run_id: str) -> RunInfo | None: ...

    @abc.abstractmethod
    async def segments(self, keys: Sequence[int]) -> dict[int, StoredSegment]: ...

    @abc.abstractmethod
    async def lexical_search(
        self, scope: Scope, filters: Filters, terms: Sequence[str], limit: int
    ) -> list[Hit]:
        """Segments matching any of `terms`, best first, with a BM25-like score."""

    async def lexical_search_each(
        self, scope: Scope, filters: Filters, term_lists: Sequence[Sequence[str]], limit: int
    ) -> list[list[Hit]]:
        """`lexical_search` of each list of terms (a store may do them together);
        an empty list finds nothing."""
        return [
            await self.lexical_search(scope, filters, terms, limit) if terms else [] for terms in term_lists
        ]

    async def term_rarity(self, terms: Sequence[str]) -> dict[str, float]:
        """How much each term says (`ranking.rarity`: rare terms weigh more, absent
        ones nothing); by default all alike."""
        return dict.fromkeys(terms, 1.0)

    @abc.abstractmethod
    async def vector_search(
        self, scope: Scope, filters: Filters, query: Vector, language: str, limit: int
    ) -> list[Hit]:
        """Embedded segments by centered cosine to `query`, best first."""

    @abc.abstractmethod
    async def visible_segment(self, scope: Scope, ref: Ref) -> StoredSegment | None:
        """The segment at `ref` if the scope may see it."""

    @abc.abstractmethod
    async def neighbours(
        self, scope: Scope, focus: StoredSegment, *, before: int, after: int
    ) -> tuple[list[StoredSegment], list[StoredSegment]]:
        """Visible segments of the focus's run just before and after it, in order."""

    @abc.abstractmethod
    async def pending_count(self, scope: Scope | None = None) -> int:
        """Segments still without a vector, in the scope's agent or workspace (all audiences)."""

    @abc.abstractmethod
    async def forget(self, target: ForgetTarget) -> int:
        """Deletes the target's segments (and runs left empty); returns how many segments.

        A target naming no id at all means every segment (before `target.before`):
        the retention sweep's delete.
        """

    @abc.abstractmethod
    async def target_workspaces(self, target: ForgetTarget) -> set[str]:
        """The workspaces the target's runs belong to (empty if none is stored)."""

    @abc.abstractmethod
    async def target_agents(self, target: ForgetTarget) -> set[str]:
        """The agents whose stored runs the target names (a workspace's: all of them)."""

    @abc.abstractmethod
    async def stats(self, *, agent_id: str = "", workspace_id: str = "") -> MemoryStats: ...

    @abc.abstractmethod
    async def pending_embeddings(self, limit: int) -> list[PendingSegment]: ...

    @abc.abstractmethod
    async def store_embeddings(
        self, pending: Sequence[PendingSegment], vectors: npt.NDArray[np.float32]
    ) -> int:
        """Stores vectors of segments still there; returns how many were stored."""

    async def aclose(self) -> None:  # noqa: B027
        """Closes connections. Idempotent."""

"""The memory's use cases: archive, retrieve, expand, forget, stats, each
after checking who asks (see `Caller`) against what the IM says they are."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from services.memory.domain import hybrid
from services.memory.domain.duplicates import collapse
from services.memory.domain.errors import (
    DirectoryUnavailable,
    InvalidRequest,
    NotAllowed,
    NotFound,
    Unauthenticated,
)
from services.memory.domain.hybrid import Candidates, searchable_concepts
from services.memory.domain.lexicon import translate, translated_terms
from services.memory.domain.model import (
    ArchivedRun,
    MemoryStats,
    RankedSegment,
    Ref,
    RunInfo,
    SegmentType,
    StoredSegment,
)
from services.memory.domain.ranking import FusionSettings, Hit
from services.memory.domain.scope import Filters, ForgetTarget, Scope
from services.memory.domain.segmentation import RunLimits, SplitSettings, check_run, content_hash, segment_run
from services.memory.domain.supersession import SupersessionSettings
from services.memory.domain.terms import language_of, lexical_terms
from services.memory.service_layer.ports import (
    Dictionary,
    Embedder,
    MemberDirectory,
    MemberInfo,
    MemoryStore,
    Vector,
)

logger = logging.getLogger(__name__)

# What a person who neither owns an agent nor administers the workspace
# finds of its memory: what was said in the chats, not its reasoning or
# tool calls (its work, as its steps are).
SAID = frozenset({SegmentType.USER_MESSAGE, SegmentType.RESPONSE})
_ADMINISTERS = frozenset({"owner", "admin"})


@dataclass(frozen=True, slots=True)
class Caller:
    """Who calls: a member (from its access token), or a service's own token,
    which acts for nobody (`is_service`, an administrator's call)."""

    member_id: str | None
    is_service: bool = False
    # The member's workspace roles, as its token says (owner, admin, member).
    roles: tuple[str, ...] = ()

    @property
    def administers(self) -> bool:
        return bool(_ADMINISTERS & set(self.roles))


@dataclass(frozen=True, slots=True)
class QueryLimits:
    max_query_chars: int = 2000
    max_query_terms: int = 64
    # Terms searched for a query's words in the other language (see `domain.lexicon`).
    max_translated_terms: int = 64
    max_audience: int = 1000
    default_limit: int = 10
    max_limit: int = 100
    default_context: int = 3
    max_context: int = 50
    # Candidates each method brings before fusion.
    candidates: int = 50
    # How long a query may wait for its vector before it goes lexical only.
    query_embedding_seconds: float = 2.0


@dataclass(frozen=True, slots=True)
class ArchiveResult:
    segment_count: int
    changed: bool


@dataclass(frozen=True, slots=True)
class Retrieved:
    results: list[RankedSegment]
    pending_embeddings: int


@dataclass(frozen=True, slots=True)
class Expanded:
    focus: StoredSegment
    before: list[StoredSegment]
    after: list[StoredSegment]
    run: RunInfo


@dataclass(frozen=True, slots=True)
class AgentScopeRequest:
    agent_id: str
    audience: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WorkspaceScopeRequest:
    workspace_id: str


ScopeRequest = AgentScopeRequest | WorkspaceScopeRequest


class Memory:
    """The memory service's handlers.

    Args:
        store: where segments live.
        embedder: for query vectors (segments are embedded by the worker).
        directory: who members are.
        dictionary: for looking for a query's words in the other language
            (Chinese <-> English); without one, or while it loads, search
            does without.
        on_archived: called after a run's segments changed (wakes the embedder).
    """

    def __init__(
        self,
        *,
        store: MemoryStore,
        embedder: Embedder | None,
        directory: MemberDirectory,
        split: SplitSettings | None = None,
        run_limits: RunLimits | None = None,
        query_limits: QueryLimits | None = None,
        fusion: FusionSettings | None = None,
        supersession: SupersessionSettings | None = None,
        dictionary: Dictionary | None = None,
        on_archived: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._embedder = embedder
        self._directory = directory
        self._split = split or SplitSettings()
        self._run_limits = run_limits or RunLimits()
        self.limits = query_limits or QueryLimits()
        self._fusion = fusion or FusionSettings()
        self._supersession = supersession or SupersessionSettings()
        self._dictionary = dictionary
        self._on_archived = on_archived

    # -- who asks -----------------------------------------------------------

    async def _member(self, caller: Caller) -> MemberInfo:
        if caller.member_id is None and caller.is_service:
            # Its token is genuine (UNAUTHENTICATED would say it is not): it
            # acts for no member, and these calls need one.
            raise NotAllowed("a service's own token acts for no member: call with the member's token")
        if caller.member_id is None:
            raise Unauthenticated("this call needs the acting member: authorization: Bearer <access token>")
        found = await self._directory.member(caller.member_id)
        if found is None:
            raise Unauthenticated(f"member {caller.member_id} is not known to the IM")
        return found

    async def _works_for(self, caller: Caller, member: MemberInfo, agent_id: str) -> bool:
        """Whether `member` may read and change the agent's work: it is the
        agent, its owner, or an admin or owner of the workspace."""
        if caller.administers:
            return True
        identity = await self._store.agent_identity(agent_id)
        if identity is None or identity.agent_member_id == member.member_id:
            return True  # nothing stored yet, or the agent itself
        agent = await self._directory.member(identity.agent_member_id)
        return agent is not None and agent.owner_id == member.member_id

    async def _scope(
        self, caller: Caller, request: ScopeRequest | None
    ) -> tuple[Scope | None, frozenset[SegmentType]]:
        """The scope to read (None when it holds nothing: an agent with no
        memory yet), and the kinds of segment the caller may see in it (empty: all)."""
        member = await self._member(caller)
        if request is None:
            raise InvalidRequest("scope is required: agent or workspace")
        if isinstance(request, WorkspaceScopeRequest):
            workspace = request.workspace_id or member.workspace_id
            if workspace != member.workspace_id:
                raise NotAllowed("a workspace can be searched only by its own members")
            # A person searching the workspace finds what was said in the
            # chats they are in; an agent's work is read in its own scope.
            sees: frozenset[SegmentType] = frozenset() if caller.administers else SAID
            return Scope(workspace_id=workspace, audience=frozenset({member.member_id})), sees
        if not request.agent_id:
            raise InvalidRequest("agent.agent_id is required")
        if len(request.audience) > self.limits.max_audience:
            raise InvalidRequest(
                f"agent.audience_member_ids has more than {self.limits.max_audience} members"
            )
        if any(not member_id or len(member_id) > 128 for member_id in request.audience):
            raise InvalidRequest("agent.audience_member_ids: every id must be 1 to 128 characters")
        identity = await self._store.agent_identity(request.agent_id)
        if identity is None:
            return None, frozenset()
        if identity.workspace_id != member.workspace_id:
            raise NotAllowed(f"agent {request.agent_id} is not in your workspace")
        audience = set(request.audience)
        if member.member_id != identity.agent_member_id:
            # Whoever reads an agent's memory other than the agent sees the results.
            audience.add(member.member_id)
        scope = Scope(
            workspace_id=identity.workspace_id, audience=frozenset(audience), agent_id=request.agent_id
        )
        return scope, frozenset() if await self._works_for(caller, member, request.agent_id) else SAID

    # -- use cases ----------------------------------------------------------

    async def archive_run(self, caller: Caller, run: ArchivedRun) -> ArchiveResult:
        check_run(run, self._run_limits)
        member = await self._member(caller)
        if member.member_id != run.agent_member_id or member.workspace_id != run.workspace_id:
            raise NotAllowed("a run is archived by its own agent (the caller must be run.agent_member_id)")
        identity = await self._store.agent_identity(run.agent_id)
        if identity is not None and identity.agent_member_id != run.agent_member_id:
            raise NotAllowed(f"agent {run.agent_id} has another member id")
        drafts = segment_run(run, self._split)
        if len(drafts) > self._run_limits.max_segments:
            raise InvalidRequest(
                f"the run makes {len(drafts)} segments; at most {self._run_limits.max_segments} are accepted"
            )
        changed = await self._store.archive(run, drafts, content_hash(run, drafts))
        if changed:
            self._on_archived()
        return ArchiveResult(segment_count=len(drafts), changed=changed)

    async def retrieve(
        self,
        caller: Caller,
        request: ScopeRequest | None,
        *,
        query: str,
        limit: int,
        filters: Filters,
        prefer_recent: bool,
    ) -> Retrieved:
        query = query.strip()
        if not query:
            raise InvalidRequest("query is required")
        if len(query) > self.limits.max_query_chars:
            raise InvalidRequest(f"query is longer than {self.limits.max_query_chars} characters")
        if limit < 0 or limit > self.limits.max_limit:
            raise InvalidRequest(f"limit must be between 0 and {self.limits.max_limit}, got {limit}")
        limit = limit or self.limits.default_limit
        _check_filters(filters)
        scope, sees = await self._scope(caller, request)
        if sees:
            filters = replace(filters, types=filters.types & sees if filters.types else sees)
        if scope is None or (not filters.types and sees):
            return Retrieved([], 0)
        terms = list(dict.fromkeys(lexical_terms(query)))[: self.limits.max_query_terms]
        lexicon = self._dictionary.lexicon() if self._dictionary is not None else None
        concepts = translate(query, lexicon) if lexicon is not None else []
        extra = translated_terms(concepts, leave_out=set(terms), limit=self.limits.max_translated_terms)
        concepts = searchable_concepts(concepts, {*terms, *extra})
        candidates = max(self.limits.candidates, limit * 3)
        # The model embeds the query (on its own thread) while the database searches lexically.
        embedding = asyncio.ensure_future(self._query_vector(query))
        try:
            lexical, translated = await self._store.lexical_search_each(
                scope, filters, [terms, extra], candidates
            )
        except BaseException:
            embedding.cancel()
            raise
        vector: list[Hit] = []
        query_vector = await embedding
        if query_vector is not None:
            vector = await self._store.vector_search(
                scope, filters, query_vector, language_of(query), candidates
            )
        keys = {hit.key for hits in (lexical, translated, vector) for hit in hits}
        found = await self._store.segments(sorted(keys))
        # Rarer terms weigh more: a rare name matched says more than "the".
        weights = await self._store.term_rarity([*terms, *extra]) if terms or extra else {}
        fused = hybrid.rank(
            terms,
            concepts,
            Candidates(
                [hit for hit in vector if hit.key in found],
                [hit for hit in lexical if hit.key in found],
                [hit for hit in translated if hit.key in found],
                terms={key: _terms(segment) for key, segment in found.items()},
                times={key: segment.created_at.timestamp() for key, segment in found.items()},
            ),
            weights,
            limit=len(keys),
            prefer_recent=prefer_recent,
            fusion=self._fusion,
            supersession=self._supersession,
        )
        ranked = [(found[hit.key], hit.score) for hit in fused if hit.key in found]
        return Retrieved(collapse(ranked, limit), await self._store.pending_count(scope))

    async def _query_vector(self, query: str) -> Vector | None:
        if self._embedder is None:
            return None
        try:
            return await asyncio.wait_for(
                self._embedder.embed_query(query), self.limits.query_embedding_seconds
            )
        except Exception as error:  # a slow or broken embedder must not fail the search
            logger.warning("query embedding failed (%s); searching lexically only", type(error).__name__)
            return None

    async def expand(
        self, caller: Caller, request: ScopeRequest | None, *, ref: str, before: int, after: int
    ) -> Expanded:
        anchor = Ref.parse(ref)
        before = self._context(before, "before")
        after = self._context(after, "after")
        scope, sees = await self._scope(caller, request)
        # Invisible and missing look alike: existence is not for the caller to learn.
        focus = await self._store.visible_segment(scope, anchor) if scope is not None else None
        if (
            scope is None
            or focus is None
            or (scope.agent_id is not None and focus.agent_id != scope.agent_id)
            or (sees and focus.type not in sees)
        ):
            raise NotFound(f"no segment {anchor} in this memory")
        earlier, later = await self._store.neighbours(scope, focus, before=before, after=after)
        if sees:
            earlier, later = [s for s in earlier if s.type in sees], [s for s in later if s.type in sees]
        run = await self._store.run_info(focus.run_id)
        if run is None:
            raise NotFound(f"no segment {anchor} in this memory")
        return Expanded(focus=focus, before=earlier, after=later, run=run)

    def _context(self, count: int, name: str) -> int:
        if count < 0 or count > self.limits.max_context:
            raise InvalidRequest(f"{name} must be between 0 and {self.limits.max_context}, got {count}")
        return count or self.limits.default_context

    async def forget(self, caller: Caller, target: ForgetTarget) -> int:
        named = [
            name for name in ("run_id", "session_id", "agent_id", "workspace_id") if getattr(target, name)
        ]
        if len(named) != 1:
            raise InvalidRequest("name what to forget: one of run_id, session_id, agent_id, workspace_id")
        if caller.member_id is None and caller.is_service:
            # A trusted service acting for nobody: an administrator's call.
            return await self._store.forget(target)
        member = await self._member(caller)
        workspaces = await self._store.target_workspaces(target)
        if workspaces - {member.workspace_id}:
            raise NotAllowed("what you forget must be in your own workspace")
        if not workspaces:
            return 0
        # Forgetting changes an agent's work: its owner's and the admins' to do.
        if target.workspace_id and not caller.administers:
            raise NotAllowed("only the workspace's admins and owner forget the whole workspace's memory")
        for agent_id in sorted(await self._store.target_agents(target)):
            if not await self._works_for(caller, member, agent_id):
                raise NotAllowed(
                    f"agent {agent_id}'s memory is forgotten by its owner or the workspace's admins"
                )
        return await self._store.forget(target)

    async def stats(self, caller: Caller, *, agent_id: str, workspace_id: str) -> MemoryStats:
        if bool(agent_id) == bool(workspace_id):
            raise InvalidRequest("name one scope: agent_id or workspace_id")
        if not (caller.member_id is None and caller.is_service):
            member = await self._member(caller)
            if workspace_id and workspace_id != member.workspace_id:
                raise NotAllowed("a workspace's memory is shown only to its own members")
            if agent_id:
                identity = await self._store.agent_identity(agent_id)
                if identity is not None and identity.workspace_id != member.workspace_id:
                    raise NotAllowed(f"agent {agent_id} is not in your workspace")
        return await self._store.stats(agent_id=agent_id, workspace_id=workspace_id)


def _terms(segment: StoredSegment) -> frozenset[str]:
    """The segment's lexical terms: as the store read them, or made again."""
    return frozenset(segment.terms.split(" ") if segment.terms else lexical_terms(segment.text))


def _check_filters(filters: Filters) -> None:
    if filters.since is not None and filters.until is not None and filters.until <= filters.since:
        raise InvalidRequest("filters.until must be after filters.since")
    if len(filters.exclude_run_ids) > 1000:
        raise InvalidRequest("filters.exclude_run_ids has more than 1000 runs")


def utc_now() -> datetime:
    return datetime.now(UTC)


__all__ = [
    "AgentScopeRequest",
    "ArchiveResult",
    "Caller",
    "DirectoryUnavailable",
    "Expanded",
    "Memory",
    "QueryLimits",
    "Retrieved",
    "WorkspaceScopeRequest",
]

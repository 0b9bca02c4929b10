"""An in-memory `MemoryStore` for the memory's handler tests: same port, plain Python."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from services.memory.domain.audience import visible
from services.memory.domain.duplicates import dedup_key
from services.memory.domain.errors import NotAllowed
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
from services.memory.domain.terms import language_of, lexical_terms
from services.memory.service_layer.ports import AgentIdentity, MemoryStore, PendingSegment, Vector


@dataclass
class _Row:
    segment: StoredSegment
    members: frozenset[str] | None
    language: str
    vector: npt.NDArray[np.float32] | None = None


class InMemoryStore(MemoryStore):
    def __init__(self) -> None:
        self.runs: dict[str, tuple[RunInfo, str]] = {}
        self.rows: dict[int, _Row] = {}
        self._next_key = 1
        self.archive_writes = 0

    async def archive(self, run: ArchivedRun, drafts: Sequence[SegmentDraft], content_hash: str) -> bool:
        existing = self.runs.get(run.run_id)
        if existing is not None:
            if (existing[0].workspace_id, existing[0].agent_id) != (run.workspace_id, run.agent_id):
                raise NotAllowed(f"run {run.run_id} belongs to another agent")
            if existing[1] == content_hash:
                return False
        self.archive_writes += 1
        self.rows = {k: r for k, r in self.rows.items() if r.segment.run_id != run.run_id}
        info = RunInfo(
            run.run_id,
            run.workspace_id,
            run.agent_id,
            run.agent_member_id,
            run.session_id,
            run.started_at,
            run.ended_at,
            len(drafts),
        )
        self.runs[run.run_id] = (info, content_hash)
        for draft in drafts:
            key = self._next_key
            self._next_key += 1
            segment = StoredSegment(
                key,
                run.workspace_id,
                run.agent_id,
                run.session_id,
                run.run_id,
                draft.step_sequence,
                draft.segment_index,
                draft.type,
                draft.text,
                draft.tool_name,
                draft.group_id,
                draft.created_at,
                dedup_key(draft.text),
            )
            members = run.conversations[draft.group_id] if draft.group_id else None
            self.rows[key] = _Row(segment, members, language_of(draft.text))
        return True

    async def agent_identity(self, agent_id: str) -> AgentIdentity | None:
        for info, _ in self.runs.values():
            if info.agent_id == agent_id:
                return AgentIdentity(info.workspace_id, info.agent_member_id)
        return None

    async def run_info(self, run_id: str) -> RunInfo | None:
        found = self.runs.get(run_id)
        if found is None:
            return None
        count = sum(1 for r in self.rows.values() if r.segment.run_id == run_id)
        return replace(found[0], segment_count=count)

    async def segments(self, keys: Sequence[int]) -> dict[int, StoredSegment]:
        return {k: self.rows[k].segment for k in keys if k in self.rows}

    def _matches(self, row: _Row, scope: Scope, filters: Filters) -> bool:
        s = row.segment
        if s.workspace_id != scope.workspace_id or (
            scope.agent_id is not None and s.agent_id != scope.agent_id
        ):
            return False
        if not visible(row.members, scope.audience, agent_scope=scope.agent_scope):
            return False
        return (
            (not filters.types or s.type in filters.types)
            and (filters.since is None or s.created_at >= filters.since)
            and (filters.until is None or s.created_at < filters.until)
            and (not filters.group_id or s.group_id == filters.group_id)
            and (not filters.agent_id or s.agent_id == filters.agent_id)
            and s.run_id not in filters.exclude_run_ids
        )

    async def lexical_search(
        self, scope: Scope, filters: Filters, terms: Sequence[str], limit: int
    ) -> list[Hit]:
        wanted = set(terms)
        hits = []
        for key, row in self.rows.items():
            if not self._matches(row, scope, filters):
                continue
            counts = Counter(lexical_terms(row.segment.text))
            score = sum(math.log1p(counts[t]) for t in wanted if counts[t])
            if score:
                hits.append(Hit(key, score))
        return sorted(hits, key=lambda h: (-h.score, h.key))[:limit]

    async def vector_search(
        self, scope: Scope, filters: Filters, query: Vector, language: str, limit: int
    ) -> list[Hit]:
        hits = [
            Hit(key, float(row.vector @ query))
            for key, row in self.rows.items()
            if row.vector is not None and self._matches(row, scope, filters)
        ]
        return sorted(hits, key=lambda h: (-h.score, h.key))[:limit]

    async def visible_segment(self, scope: Scope, ref: Ref) -> StoredSegment | None:
        for row in self.rows.values():
            if row.segment.ref == ref and self._matches(row, scope, Filters()):
                return row.segment
        return None

    async def neighbours(
        self, scope: Scope, focus: StoredSegment, *, before: int, after: int
    ) -> tuple[list[StoredSegment], list[StoredSegment]]:
        same = sorted(
            (
                r.segment
                for r in self.rows.values()
                if r.segment.run_id == focus.run_id and self._matches(r, scope, Filters())
            ),
            key=lambda s: (s.step_sequence, s.segment_index),
        )
        position = [s.key for s in same].index(focus.key)
        return same[max(0, position - before) : position], same[position + 1 : position + 1 + after]

    async def pending_count(self, scope: Scope | None = None) -> int:
        return sum(
            1
            for r in self.rows.values()
            if r.vector is None and (scope is None or self._matches(r, scope, Filters()))
        )

    async def forget(self, target: ForgetTarget) -> int:
        def doomed(s: StoredSegment) -> bool:
            named = all(
                not getattr(target, name) or getattr(s, name) == getattr(target, name)
                for name in ("run_id", "session_id", "agent_id", "workspace_id")
            )
            return named and (target.before is None or s.created_at < target.before)

        gone = [k for k, r in self.rows.items() if doomed(r.segment)]
        for key in gone:
            del self.rows[key]
        return len(gone)

    def _targeted(self, target: ForgetTarget) -> list[RunInfo]:
        """The runs stored that `target` names, by any of its ids."""
        return [
            info
            for info, _ in self.runs.values()
            if any(
                getattr(target, name) and getattr(info, name) == getattr(target, name)
                for name in ("run_id", "session_id", "agent_id", "workspace_id")
            )
        ]

    async def target_workspaces(self, target: ForgetTarget) -> set[str]:
        if target.workspace_id:
            return {target.workspace_id}
        return {info.workspace_id for info in self._targeted(target)}

    async def target_agents(self, target: ForgetTarget) -> set[str]:
        return {info.agent_id for info in self._targeted(target)}

    async def stats(self, *, agent_id: str = "", workspace_id: str = "") -> MemoryStats:
        rows = [
            r.segment
            for r in self.rows.values()
            if (agent_id and r.segment.agent_id == agent_id)
            or (workspace_id and r.segment.workspace_id == workspace_id)
        ]
        times = [s.created_at for s in rows]
        runs = {s.run_id for s in rows}
        pending = sum(1 for r in self.rows.values() if r.vector is None and r.segment in rows)
        return MemoryStats(len(runs), len(rows), pending, min(times, default=None), max(times, default=None))

    async def pending_embeddings(self, limit: int) -> list[PendingSegment]:
        return [
            PendingSegment(k, r.segment.text, r.language)
            for k, r in sorted(self.rows.items())
            if r.vector is None
        ][:limit]

    async def store_embeddings(
        self, pending: Sequence[PendingSegment], vectors: npt.NDArray[np.float32]
    ) -> int:
        stored = 0
        for item, vector in zip(pending, vectors, strict=True):
            row = self.rows.get(item.key)
            if row is not None and row.vector is None:
                row.vector = np.asarray(vector, dtype=np.float32)
                stored += 1
        return stored

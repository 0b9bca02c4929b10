"""Fakes and builders for the memory service's tests."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import numpy as np
import numpy.typing as npt
from google.protobuf import timestamp_pb2

from agentim.memory.v1 import memory_pb2 as pb
from services.common.tokens import PrincipalKind
from services.memory.domain.lexicon import Lexicon, parse_cedict
from services.memory.domain.terms import lexical_terms
from services.memory.service_layer.ports import Dictionary, Embedder, MemberDirectory, MemberInfo, Vector
from tests.identities import Identity, remember

START = datetime(2026, 11, 1, 9, 0, tzinfo=UTC)


class FakeEmbedder(Embedder):
    """Deterministic and fast: each term gets a fixed random direction and a
    text is the normalized sum of its terms', so texts sharing words are
    near. `synonyms` maps a term to another one whose direction it borrows
    (to have a "paraphrase" that shares no term). `fail` makes every call raise.
    """

    name = "fake"

    def __init__(self, dimensions: int = 64, synonyms: dict[str, str] | None = None) -> None:
        self.dimensions = dimensions
        self.synonyms = synonyms or {}
        self.fail = False
        self.passages_embedded = 0

    def _direction(self, term: str) -> npt.NDArray[np.float32]:
        term = self.synonyms.get(term, term)
        seed = int.from_bytes(hashlib.sha256(term.encode()).digest()[:8], "little")
        return np.random.default_rng(seed).standard_normal(self.dimensions).astype(np.float32)

    def vector(self, text: str) -> Vector:
        total = np.zeros(self.dimensions, dtype=np.float32)
        for term in lexical_terms(text):
            total += self._direction(term)
        norm = float(np.linalg.norm(total))
        return total / norm if norm > 0 else total

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if self.fail:
            raise ConnectionError("the fake embedder is down")
        self.passages_embedded += len(texts)
        return (
            np.stack([self.vector(text) for text in texts])
            if texts
            else np.zeros((0, self.dimensions), np.float32)
        )

    async def embed_query(self, text: str) -> Vector:
        if self.fail:
            raise ConnectionError("the fake embedder is down")
        return self.vector(text)


# A few CC-CEDICT entries, in its own format.
SMALL_CEDICT = """\
配額 配额 [pei4 e2] /quota/ration/
部署 部署 [bu4 shu3] /to dispose/to deploy/deployment/
失敗 失败 [shi1 bai4] /to be defeated/to lose/to fail (e.g. experiments)/failure/defeat/
值班 值班 [zhi2 ban1] /to work a shift/on duty/
合作方 合作方 [he2 zuo4 fang1] /(business) partner/
""".splitlines()


class FixedDictionary(Dictionary):
    """A dictionary that is there at once (or, with `loaded=False`, never)."""

    def __init__(self, lexicon: Lexicon | None = None, *, loaded: bool = True) -> None:
        self._lexicon = (lexicon or parse_cedict(SMALL_CEDICT)) if loaded else None

    def lexicon(self) -> Lexicon | None:
        return self._lexicon


@dataclass
class FakeDirectory(MemberDirectory):
    members: dict[str, MemberInfo] = field(default_factory=dict)

    def add(self, workspace_id: str, *, is_agent: bool = False, owner_id: str = "") -> str:
        """A new member of the workspace (an agent, with its owner), whose tokens tests may sign."""
        member_id = str(uuid.uuid4())
        self.members[member_id] = MemberInfo(member_id, workspace_id, is_agent, owner_id)
        kind = PrincipalKind.AGENT if is_agent else PrincipalKind.HUMAN
        remember(member_id, Identity(uuid.UUID(workspace_id), kind))
        return member_id

    def owner_of(self, agent_member_id: str, *, owner: str = "") -> str:
        """The agent's owner (who may forget its memory): `owner`, or a new
        person of its workspace."""
        agent = self.members[agent_member_id]
        owner = owner or self.add(agent.workspace_id)
        self.members[agent_member_id] = replace(agent, owner_id=owner)
        return owner

    async def member(self, member_id: str) -> MemberInfo | None:
        return self.members.get(member_id)


def stamp(value: datetime) -> timestamp_pb2.Timestamp:
    result = timestamp_pb2.Timestamp()
    result.FromDatetime(value)
    return result


@dataclass
class RunBuilder:
    """Builds an ArchivedRun proto step by step."""

    workspace_id: str
    agent_id: str
    agent_member_id: str
    session_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    run_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    start: datetime = START
    steps: list[pb.ArchivedStep] = field(default_factory=list)
    conversations: dict[str, list[str]] = field(default_factory=dict)

    def step(
        self,
        role: int,
        content: str = "",
        *,
        group: str = "",
        members: Sequence[str] = (),
        reasoning: str = "",
        tool_calls: Sequence[tuple[str, str]] = (),
        tool_name: str = "",
        summary: bool = False,
        at: datetime | None = None,
    ) -> RunBuilder:
        sequence = len(self.steps) + 1
        if group:
            self.conversations[group] = sorted({*members, self.agent_member_id})
        self.steps.append(
            pb.ArchivedStep(
                sequence=sequence,
                role=role,  # type: ignore[arg-type]
                content=content,
                reasoning=reasoning,
                tool_calls=[
                    pb.ToolCall(id=f"call-{i}", name=n, arguments=a) for i, (n, a) in enumerate(tool_calls)
                ],
                tool_name=tool_name,
                group_id=group,
                create_time=stamp(at or self.start + timedelta(seconds=sequence)),
                summary=summary,
            )
        )
        return self

    def user(self, content: str, **kw: object) -> RunBuilder:
        return self.step(pb.STEP_ROLE_USER, content, **kw)  # type: ignore[arg-type]

    def assistant(self, content: str, **kw: object) -> RunBuilder:
        return self.step(pb.STEP_ROLE_ASSISTANT, content, **kw)  # type: ignore[arg-type]

    def build(self) -> pb.ArchivedRun:
        return pb.ArchivedRun(
            workspace_id=self.workspace_id,
            agent_id=self.agent_id,
            agent_member_id=self.agent_member_id,
            session_id=self.session_id,
            run_id=self.run_id,
            start_time=stamp(self.start),
            end_time=stamp(self.start + timedelta(seconds=len(self.steps) + 1)),
            steps=self.steps,
            conversations=[pb.Conversation(group_id=g, member_ids=m) for g, m in self.conversations.items()],
        )

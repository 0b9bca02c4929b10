"""What every runner shares: the loop's settings, the IM directory, the history cache."""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from services.common import errors
from services.runtime.domain.errors import IMError
from services.runtime.domain.etiquette import ChatterGuard, GroupPolicy
from services.runtime.domain.model import Step
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.leases import Fences, Unfenced
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.memory_port import MemoryPort
from services.runtime.service_layer.read_positions import ReadPositions
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tools import SubAgentFactory, ToolRegistry
from services.runtime.service_layer.work import TaskQueue

# When runs must leave the context, enough leave to bring it down to this
# share of the budget, so that a summary is written now and then, not at every call.
SUMMARY_HEADROOM = 0.6


# Most runs a recall leaves out as already in the context (the memory's limit).
MAX_EXCLUDED_RUNS = 1000


# Why a run that was in flight when its process stopped ended.
STOPPED_DURING_RUN = "the runtime stopped during the run"


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Limits of the loop; all configurable."""

    max_iterations: int = 10
    group_policy: GroupPolicy = GroupPolicy.UNLESS_OTHERS_MENTIONED
    default_token_budget: int = 1_000_000
    unread_batch: int = 200
    # An answer longer than this is sent as several messages (the IM's limit).
    max_reply_bytes: int = 64 * 1024
    # Memories recalled into a new run from its input (0: none), and how long
    # recall may take before the run goes on without.
    auto_recall: int = 3
    recall_timeout_seconds: float = 3.0
    # Memories scoring below this are not recalled automatically (the recall
    # tool shows them all): better nothing than noise in every run.
    recall_min_score: float = 0.3
    # The context window: the model named when an agent names none (with an
    # endpoint, and without one: the offline model), and the window of a
    # model whose window is not known (OPENAI_CONTEXT_TOKENS).
    default_model: str = ""
    unconfigured_model: str = "offline"
    context_tokens: int | None = None
    # A stream that breaks off after it began is asked for again this many
    # times (the LLM adapter retries the ones that fail before), after a wait
    # that starts here and doubles.
    stream_cut_retries: int = 4
    stream_cut_backoff_seconds: float = 0.5


# Senders of replied-to messages kept at once (the cache starts over when full).
_KNOWN_SENDERS = 10_000


class Directory:
    """Names and kinds of members and groups, cached (they rarely change)."""

    def __init__(self, im: IMPort) -> None:
        self._im = im
        self._names: dict[uuid.UUID, str] = {}
        self._kinds: dict[uuid.UUID, str] = {}
        self._direct: dict[uuid.UUID, bool] = {}
        self._labels: dict[uuid.UUID, str] = {}
        self._senders: dict[uuid.UUID, uuid.UUID] = {}

    async def _member(self, as_member: uuid.UUID, member_id: uuid.UUID) -> None:
        member = await self._im.get_member(as_member, member_id)
        self._names[member_id] = member.display_name
        self._kinds[member_id] = member.kind

    async def name(self, as_member: uuid.UUID, member_id: uuid.UUID) -> str:
        if member_id not in self._names:
            await self._member(as_member, member_id)
        return self._names[member_id]

    async def is_person(self, as_member: uuid.UUID, member_id: uuid.UUID) -> bool:
        if member_id not in self._kinds:
            await self._member(as_member, member_id)
        return self._kinds[member_id] == "human"

    async def sender(self, as_member: uuid.UUID, message_id: uuid.UUID) -> uuid.UUID | None:
        """Who sent a message (None if it is not to be seen); messages keep their sender."""
        if message_id not in self._senders:
            if len(self._senders) >= _KNOWN_SENDERS:
                self._senders.clear()
            try:
                message = await self._im.get_message(as_member, message_id)
            except IMError as error:
                if isinstance(error, errors.Unavailable):
                    raise
                return None
            self._senders[message_id] = message.sender_id
        return self._senders[message_id]

    async def group(self, as_member: uuid.UUID, group_id: uuid.UUID) -> tuple[bool, str]:
        """(is it a direct chat, its name)."""
        if group_id not in self._direct:
            group = await self._im.get_group(as_member, group_id)
            self._direct[group_id] = group.kind == "direct"
            self._labels[group_id] = group.name
        return self._direct[group_id], self._labels[group_id]


class HistoryCache:
    """The steps of recently active agents, kept between their runs.

    An agent woken again soon (as in a conversation) then skips reloading its
    history; the least recently used are dropped once all of them hold more
    than `max_steps` steps, so idle agents cost no memory. Only an agent's
    own runner changes its steps, which keeps the copy right.
    """

    def __init__(self, max_steps: int = 20_000) -> None:
        self.max_steps = max_steps
        self._steps: OrderedDict[uuid.UUID, list[Step]] = OrderedDict()
        self._total = 0

    def take(self, agent_id: uuid.UUID) -> list[Step] | None:
        steps = self._steps.pop(agent_id, None)
        if steps is not None:
            self._total -= len(steps)
        return steps

    def keep(self, agent_id: uuid.UUID, steps: list[Step]) -> None:
        self.take(agent_id)
        if len(steps) > self.max_steps:
            return
        self._steps[agent_id] = steps
        self._total += len(steps)
        while self._total > self.max_steps:
            _, dropped = self._steps.popitem(last=False)
            self._total -= len(dropped)

    def __len__(self) -> int:
        return len(self._steps)


@dataclass(frozen=True, slots=True)
class RunnerEnv:
    """What every runner shares."""

    store: AgentStore
    im: IMPort
    llm: LLM
    tools: ToolRegistry
    hub: AgentHub
    guard: ChatterGuard
    directory: Directory
    settings: LoopSettings
    create_sub_agent: SubAgentFactory
    clock: Callable[[], datetime]
    # How many runners may ask the IM for their unread messages at once.
    reads: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(32))
    history: HistoryCache = field(default_factory=HistoryCache)
    tasks: TaskQueue | None = None
    # Long-term memory: recall from it, and who to tell that a run ended.
    memory: MemoryPort | None = None
    run_ended: Callable[[], None] = lambda: None
    # Where the IM's read positions of the agents are moved (in batches);
    # None moves each at once (tests that count the calls).
    read_positions: ReadPositions | None = None
    # What the runners' writes prove themselves with: nothing, where this
    # process runs every agent; the shard leases, among several replicas.
    fences: Fences = field(default_factory=Unfenced)

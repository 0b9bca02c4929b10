"""Fault case 9: messages arriving at random moments during tool rounds, while
the IM answers late and out of order.

A fault-injecting IM port delays every answer to the runner's reads and read
marks by a random time, so that they overtake one another: an unread list may
come back after the read mark that should have emptied it, a read mark may
land after the next read. People keep writing to the agents meanwhile, while
their runs go through tool rounds. Every message must become exactly one user
step of its agent: none twice, none missed.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionAssembler,
    CompletionRequest,
    ContentDelta,
    Delta,
    FinishReason,
    Role,
    ToolCallDelta,
    Usage,
)
from services.runtime.domain.model import AgentState
from services.runtime.service_layer.im_port import IMMessage
from services.runtime.service_layer.llm_port import LLM
from tests.faults.harness import scaled
from tests.unit.test_exactly_once import GatedIM, System, system, until


class LateIM(GatedIM):
    """Answers reads and read marks after random delays, so they arrive out of order.

    An unread list is taken when asked and handed back late (it may be stale
    by then); a read mark is applied late (after later reads were answered).
    """

    def __init__(self, rng: random.Random, *, most: float) -> None:
        super().__init__()
        self._rng = rng
        self._most = most

    async def get_all_unread(self, as_member: uuid.UUID, *, limit: int = 200) -> list[IMMessage]:
        snapshot = await super().get_all_unread(as_member, limit=limit)
        await asyncio.sleep(self._rng.uniform(0, self._most))
        return snapshot

    async def mark_read(self, as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        await asyncio.sleep(self._rng.uniform(0, self._most))
        await super().mark_read(as_member, group_id, up_to)


class ToolThenAnswer(LLM):
    """Calls a tool after new input, answers after tool results: a run is always a tool round or more."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        await asyncio.sleep(self._rng.uniform(0, 0.01))
        last = request.messages[-1]
        if last.role is Role.USER:
            call = ToolCallDelta(
                index=0, id=f"call_{uuid.uuid4().hex[:8]}", name="list_groups", arguments="{}"
            )
            yield call
            assembler = CompletionAssembler()
            assembler.add(call)
            yield Completion(assembler.message(), FinishReason.TOOL_CALLS, Usage(1, 1, 0), "late")
            return
        yield ContentDelta("ok")
        yield Completion(
            ChatMessage(role=Role.ASSISTANT, content="ok"), FinishReason.STOP, Usage(1, 1, 0), "late"
        )


async def test_every_message_becomes_exactly_one_input_step_whatever_the_timing() -> None:
    rng = random.Random(uuid.uuid4().int)
    async with system(im=LateIM(rng, most=0.02), model=ToolThenAnswer(rng)) as s:
        await run_case(s, rng, agents_count=4, per_agent=scaled(25, long=150))


async def run_case(s: System, rng: random.Random, *, agents_count: int, per_agent: int) -> None:
    im = s.im
    agents = [await s.agent(f"agent-{i}") for i in range(agents_count)]
    chats = [im.group("", s.human, agent.member_id, direct=True) for agent in agents]
    sent: dict[uuid.UUID, list[str]] = {agent.id: [] for agent in agents}

    async def person(index: int) -> None:
        for number in range(per_agent):
            await asyncio.sleep(rng.uniform(0, 0.05))
            text = f"m{index}-{number}"
            im.post(s.human, chats[index].id, text)
            sent[agents[index].id].append(text)

    await asyncio.gather(*(person(i) for i in range(agents_count)))

    def all_taken() -> bool:
        return all(set(texts) <= {text for text in inputs(s, agent_id)} for agent_id, texts in sent.items())

    await until(all_taken, "every message was taken as input")
    for agent in agents:
        await s.settle(agent)
    twice, missed = [], []
    for agent in agents:
        counted = Counter(inputs(s, agent.id))
        twice += [text for text, n in counted.items() if n > 1]
        missed += [text for text in sent[agent.id] if not counted[text]]
        assert s.store.agents[agent.id].state is AgentState.IDLE
    total = sum(len(texts) for texts in sent.values())
    print(
        f"input exactly once: {total} messages to {agents_count} agents in {len(s.store.runs)} runs"
        f" ({mid_run(s)} read in after a tool round), {len(twice)} taken twice, {len(missed)} missed"
    )
    assert twice == [] and missed == []


def mid_run(s: System) -> int:
    """User steps that came right after a tool result: messages that arrived during a tool round."""
    return sum(
        1
        for steps in s.store.steps.values()
        for before, step in itertools.pairwise(steps)
        if step.role is Role.USER and before.role is Role.TOOL
    )


def inputs(s: System, agent_id: uuid.UUID) -> Sequence[str]:
    """The message texts an agent's user steps hold (one per message)."""
    agent = s.store.agents[agent_id]
    found = []
    for step in s.store.steps.get(agent.session_id, []):
        if step.role is Role.USER and step.message.content:
            found.append(step.message.content.rsplit(": ", 1)[-1])
    return found

"""The calls the benchmarks' scenarios make of the IM and the runtime, shared by them.

Each caller acts with an access token signed with the test keys
(`tests.identities.as_member`), which the servers started by
`bench.harness` accept.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import grpc

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from bench.harness import BenchError, Clients
from tests.identities import as_member, learn_agent, learn_member

T = TypeVar("T")

CALL_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 30.0
CREATE_CONCURRENCY = 32
SEND_CONCURRENCY = 64
# After CreateAgent, the runtime re-opens its IM watch of the workspace; a
# chat created while the IM sets that watch up is never delivered to it (the
# IM reads the memberships and the starting sequence in two transactions), so
# chats are created once the watch is in place: this long after one agent,
# after many once the runtime and the IM are idle.
SETTLE_S = 0.5

Metadata = tuple[tuple[str, str], ...]


class StreamEnded(BenchError):
    """A WatchAgent stream ended (with status OK) before the run it showed did."""


async def bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> tuple[list[T], Counter[str]]:
    """Runs the calls, at most `limit` at a time; returns the results (in the
    order they came) and the gRPC errors by code."""
    semaphore = asyncio.Semaphore(limit)
    errors: Counter[str] = Counter()
    results: list[T] = []

    async def one(call: Callable[[], Awaitable[T]]) -> None:
        async with semaphore:
            try:
                results.append(await call())
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] += 1

    await asyncio.gather(*(one(c) for c in calls))
    return results, errors


# --- the IM ----------------------------------------------------------------------------


def learned(member: im_pb2.Member) -> str:
    """The member's id, once its access tokens can be signed (`as_member`)."""
    learn_member(member)
    return str(member.id)


async def new_workspace(clients: Clients, name: str) -> str:
    """A workspace; returns its first member (a person), who acts for the benchmark."""
    created = await clients.im.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name=name, creator_display_name="bench person"), timeout=CALL_TIMEOUT_S
    )
    return learned(created.creator)


async def direct_chat(clients: Clients, member: str, peer: str) -> str:
    response = await clients.im.GetOrCreateDirectGroup(
        im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=peer),
        metadata=as_member(member),
        timeout=CALL_TIMEOUT_S,
    )
    return str(response.group.id)


async def send(
    clients: Clients, member: str, group: str, content: str, *, mentions: Sequence[str] = ()
) -> None:
    await clients.im.SendMessage(
        im_pb2.SendMessageRequest(group_id=group, content=content, mentions=list(mentions)),
        metadata=as_member(member),
        timeout=CALL_TIMEOUT_S,
    )


CONTENT_BYTES = 100
SEND_MEMBERS = 32


def message_content(index: int) -> str:
    """A message of CONTENT_BYTES characters, numbered."""
    text = f"benchmark message from sender {index:02d}: "
    return (text + "lorem ipsum dolor sit amet " * 5)[:CONTENT_BYTES]


@dataclass(frozen=True)
class Sender:
    metadata: Metadata
    request: im_pb2.SendMessageRequest


async def setup_senders(stub: Any) -> list[Sender]:
    """One workspace, 32 members, and for each a group of 2-3 members to send to."""
    created = await stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="bench-send", creator_display_name="bench creator"),
        timeout=CALL_TIMEOUT_S,
    )
    creator = as_member(learned(created.creator))
    responses = await asyncio.gather(
        *(
            stub.CreateMember(
                im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name=f"sender {i:02d}"),
                metadata=creator,
                timeout=CALL_TIMEOUT_S,
            )
            for i in range(SEND_MEMBERS)
        )
    )
    ids = [learned(r.member) for r in responses]
    n = len(ids)
    groups = await asyncio.gather(
        *(
            stub.CreateGroup(
                im_pb2.CreateGroupRequest(
                    name=f"send {i:02d}",
                    member_ids=[ids[(i + 1) % n], *([ids[(i + 2) % n]] if i % 2 else [])],
                ),
                metadata=as_member(ids[i]),
                timeout=CALL_TIMEOUT_S,
            )
            for i in range(n)
        )
    )
    return [
        Sender(
            as_member(ids[i]),
            im_pb2.SendMessageRequest(group_id=groups[i].group.id, content=message_content(i)),
        )
        for i in range(n)
    ]


# --- the runtime ---------------------------------------------------------------------------


async def create_agent(
    clients: Clients, person: str, name: str, *, model: rpb.ModelSettings | None = None
) -> rpb.Agent:
    response = await clients.runtime.CreateAgent(
        rpb.CreateAgentRequest(name=name, model=model), metadata=as_member(person), timeout=CALL_TIMEOUT_S
    )
    learn_agent(response.agent)
    return response.agent


async def delete_agents(clients: Clients, person: str, agents: Iterable[rpb.Agent]) -> None:
    await bounded(
        [
            partial(
                clients.runtime.DeleteAgent,
                rpb.DeleteAgentRequest(agent_id=a.id),
                metadata=as_member(person),
                timeout=CALL_TIMEOUT_S,
            )
            for a in agents
        ],
        CREATE_CONCURRENCY,
    )


async def open_watch(clients: Clients, person: str, agent_id: str) -> Any:
    """A live WatchAgent stream, subscribed (the runtime sends its headers once it is)."""
    call = clients.runtime.WatchAgent(
        rpb.WatchAgentRequest(agent_id=agent_id, live_only=True), metadata=as_member(person)
    )
    try:
        await asyncio.wait_for(call.initial_metadata(), CALL_TIMEOUT_S)
    except BaseException:
        call.cancel()
        raise
    return call


@contextlib.asynccontextmanager
async def watching(clients: Clients, person: str, agent_id: str) -> AsyncIterator[Any]:
    """A live WatchAgent stream for the block."""
    call = await open_watch(clients, person, agent_id)
    try:
        yield call
    finally:
        call.cancel()


async def until_run_ended(
    call: Any, on_event: Callable[[Any, int], None] | None = None, *, limit_s: float = RUN_TIMEOUT_S
) -> int:
    """Reads agent events until a run ends; returns its status.

    `on_event` sees each event with the time it was received (monotonic ns).
    """
    async with asyncio.timeout(limit_s):
        while True:
            try:
                response = await call.read()
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                raise StreamEnded(f"the runtime ended the watch: {error.details()}") from None
            if response is grpc.aio.EOF:
                raise StreamEnded("the WatchAgent stream ended before the run did")
            received = time.monotonic_ns()
            event = response.event
            if on_event is not None:
                on_event(event, received)
            if event.WhichOneof("event") == "run_ended":
                return int(event.run_ended.status)

"""Who sees what: the audience rule, workspaces, the caller's identity, and bad input."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.memory.v1 import memory_pb2 as pb
from services.common.tokens import PrincipalKind
from services.memory.adapters.im_directory import GrpcMemberDirectory
from tests.auth_support import service_secret
from tests.conftest import RunningIM, make_world
from tests.identities import as_member, as_unknown
from tests.integration.memory_harness import (
    WITH_PGVECTOR,
    RunningMemory,
    memory,
    memory_url,
    migrated_url,
    start_memory,
    stop_memory,
)
from tests.memory_support import START, RunBuilder, stamp

__all__ = ["memory", "memory_url"]


async def archive(memory: RunningMemory, run: pb.ArchivedRun) -> None:
    await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run), metadata=as_member(run.agent_member_id))


async def embedded(memory: RunningMemory) -> None:
    assert memory.app.worker is not None
    await asyncio.wait_for(memory.app.worker.drained(), 10)


async def texts(memory: RunningMemory, member: str, request: pb.RetrieveRequest) -> list[str]:
    response = await memory.stub.Retrieve(request, metadata=as_member(member))
    return [hit.segment.text for hit in response.results]


async def refused(call: object, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call  # type: ignore[misc]
    assert error.value.code() == code, error.value.details()
    return str(error.value.details())


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_a_person_never_finds_a_segment_from_a_group_they_are_not_in(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    alice, bob = memory.directory.add(workspace), memory.directory.add(workspace)
    run = RunBuilder(workspace, agent, agent_member)
    run.user("alpha project notes for alice", group="g-alice", members=[alice])
    run.user("alpha project notes for bob", group="g-bob", members=[bob])
    run.user("alpha project notes for both", group="g-both", members=[alice, bob])
    run.user("alpha project notes from a task")
    await archive(memory, run.build())
    await embedded(memory)  # so that vector search takes part too

    def search(query: str) -> pb.RetrieveRequest:
        return pb.RetrieveRequest(workspace=pb.WorkspaceScope(), query=query)

    assert sorted(await texts(memory, alice, search("alpha project notes"))) == [
        "alpha project notes for alice",
        "alpha project notes for both",
    ]
    assert sorted(await texts(memory, bob, search("alpha project notes"))) == [
        "alpha project notes for bob",
        "alpha project notes for both",
    ]
    # Bob's chat cannot be expanded by Alice, nor can the agent's task: as if they did not exist.
    for sequence in (2, 4):
        await refused(
            memory.stub.Expand(
                pb.ExpandRequest(workspace=pb.WorkspaceScope(), ref=f"{run.run_id}/{sequence}/0"),
                metadata=as_member(alice),
            ),
            grpc.StatusCode.NOT_FOUND,
        )
    # Expanding her own segment shows only the neighbours she may see.
    expanded = await memory.stub.Expand(
        pb.ExpandRequest(workspace=pb.WorkspaceScope(), ref=f"{run.run_id}/1/0"), metadata=as_member(alice)
    )
    assert [s.text for s in expanded.after] == ["alpha project notes for both"]


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_an_agent_scope_with_an_outsider_never_gets_a_private_chat(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    alice, bob = memory.directory.add(workspace), memory.directory.add(workspace)
    run = RunBuilder(workspace, agent, agent_member)
    run.user("the door code is 4711", group="direct-alice", members=[alice])
    run.user("the team meets on friday", group="team", members=[alice, bob])
    await archive(memory, run.build())
    await embedded(memory)

    def recall(*audience: str) -> pb.RetrieveRequest:
        return pb.RetrieveRequest(
            agent=pb.AgentScope(agent_id=agent, audience_member_ids=list(audience)),
            query="door code team friday",
        )

    assert sorted(await texts(memory, agent_member, recall(alice))) == [
        "the door code is 4711",
        "the team meets on friday",
    ]
    assert await texts(memory, agent_member, recall(alice, bob)) == ["the team meets on friday"]
    # A person reading the agent's memory is always part of the audience.
    assert await texts(memory, bob, recall()) == ["the team meets on friday"]
    assert await texts(memory, bob, recall(alice)) == ["the team meets on friday"]


async def test_no_result_ever_crosses_a_workspace(memory: RunningMemory) -> None:
    rng = random.Random(9)
    words = [f"word{i}" for i in range(60)] + ["预算", "部署失败", "ERR_QUOTA_42", "会议"]
    people: list[tuple[str, str]] = []
    for _ in range(2):
        workspace, agent, agent_member = memory.new_workspace()
        person = memory.directory.add(workspace)
        people.append((workspace, person))
        for _ in range(4):
            run = RunBuilder(workspace, agent, agent_member)
            for _ in range(10):
                run.user(" ".join(rng.sample(words, 6)), group="g", members=[person])
            await archive(memory, run.build())
    assert memory.app.worker is not None
    await memory.app.worker.drained()
    crossed = found = 0
    for _ in range(1000):
        workspace, person = rng.choice(people)
        response = await memory.stub.Retrieve(
            pb.RetrieveRequest(workspace=pb.WorkspaceScope(), query=" ".join(rng.sample(words, 3)), limit=20),
            metadata=as_member(person),
        )
        found += len(response.results)
        crossed += sum(1 for hit in response.results if hit.segment.anchor.workspace_id != workspace)
    assert found > 1000 and crossed == 0


async def test_callers_act_only_within_their_own_workspace_and_as_themselves(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    other_workspace, other_agent, other_member = memory.new_workspace()
    person = memory.directory.add(workspace)
    run = RunBuilder(workspace, agent, agent_member).user("hello")
    await archive(memory, run.build())
    request = pb.ArchiveRunRequest(run=run.build())
    await refused(
        memory.stub.ArchiveRun(request, metadata=as_member(person)), grpc.StatusCode.PERMISSION_DENIED
    )
    await refused(memory.stub.ArchiveRun(request), grpc.StatusCode.UNAUTHENTICATED)
    await refused(
        memory.stub.ArchiveRun(request, metadata=as_unknown(kind=PrincipalKind.AGENT)),
        grpc.StatusCode.UNAUTHENTICATED,
    )
    # Another agent may not take over (replace) this agent's run.
    hijack = (
        RunBuilder(other_workspace, other_agent, other_member, run_id=run.run_id).user("mine now").build()
    )
    await refused(
        memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=hijack), metadata=as_member(other_member)),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    outsider = as_member(other_member)
    await refused(
        memory.stub.Retrieve(
            pb.RetrieveRequest(agent=pb.AgentScope(agent_id=agent), query="hello"), metadata=outsider
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await refused(
        memory.stub.Retrieve(
            pb.RetrieveRequest(workspace=pb.WorkspaceScope(workspace_id=workspace), query="hello"),
            metadata=outsider,
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    # Forgetting and statistics are people's: a person of the other workspace.
    outsider = as_member(memory.directory.add(other_workspace))
    for target in (pb.ForgetRequest(run_id=run.run_id), pb.ForgetRequest(workspace_id=workspace)):
        await refused(memory.stub.Forget(target, metadata=outsider), grpc.StatusCode.PERMISSION_DENIED)
    await refused(
        memory.stub.GetMemoryStats(pb.GetMemoryStatsRequest(agent_id=agent), metadata=outsider),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    stats = await memory.stub.GetMemoryStats(
        pb.GetMemoryStatsRequest(agent_id=agent), metadata=as_member(person)
    )
    assert stats.segment_count == 1


def _invalid_requests(agent: str, run: RunBuilder) -> list[tuple[str, str, object]]:
    scope = pb.AgentScope(agent_id=agent)
    no_times = run.build()
    no_times.ClearField("start_time")
    bad_time = run.build()
    bad_time.end_time.seconds = 10**12
    return [
        ("Retrieve", "limit", pb.RetrieveRequest(agent=scope, query="x", limit=101)),
        ("Retrieve", "limit", pb.RetrieveRequest(agent=scope, query="x", limit=-1)),
        ("Retrieve", "query is required", pb.RetrieveRequest(agent=scope, query="  ")),
        ("Retrieve", "longer than 50", pb.RetrieveRequest(agent=scope, query="x" * 51)),
        ("Retrieve", "scope is required", pb.RetrieveRequest(query="x")),
        ("Retrieve", "agent_id is required", pb.RetrieveRequest(agent=pb.AgentScope(), query="x")),
        (
            "Retrieve",
            "SEGMENT_TYPE_UNSPECIFIED",
            pb.RetrieveRequest(
                agent=scope, query="x", filters=pb.RetrieveFilters(types=[pb.SEGMENT_TYPE_UNSPECIFIED])
            ),
        ),
        (
            "Retrieve",
            "until must be after",
            pb.RetrieveRequest(
                agent=scope, query="x", filters=pb.RetrieveFilters(since=stamp(START), until=stamp(START))
            ),
        ),
        (
            "Retrieve",
            "not a known SegmentType",
            pb.RetrieveRequest(
                agent=scope,
                query="x",
                filters=pb.RetrieveFilters(types=[99]),  # type: ignore[list-item]
            ),
        ),
        ("Expand", "ref must look like", pb.ExpandRequest(agent=scope, ref="nonsense")),
        ("Expand", "before must be between", pb.ExpandRequest(agent=scope, ref="r/1/0", before=51)),
        ("Forget", "name what to forget", pb.ForgetRequest()),
        ("Forget", "name what to forget", pb.ForgetRequest(run_id="")),
        ("GetMemoryStats", "name one scope", pb.GetMemoryStatsRequest()),
        ("ArchiveRun", "run is required", pb.ArchiveRunRequest()),
        ("ArchiveRun", "start_time is required", pb.ArchiveRunRequest(run=no_times)),
        ("ArchiveRun", "not a valid time", pb.ArchiveRunRequest(run=bad_time)),
        ("ArchiveRun", "at most 3 are accepted", pb.ArchiveRunRequest(run=run.build())),
    ]


async def test_every_bad_input_is_invalid_argument_with_a_reason(memory_url: str) -> None:
    running = await start_memory(memory_url, MEMORY_MAX_QUERY_CHARS="50", MEMORY_MAX_RUN_SEGMENTS="3")
    try:
        workspace, agent, agent_member = running.new_workspace()
        person = running.directory.add(workspace)
        run = RunBuilder(workspace, agent, agent_member)
        for index in range(4):
            run.user(f"message {index}")
        for method, reason, request in _invalid_requests(agent, run):
            # Each RPC as a caller it lets in: forgetting and statistics are people's.
            caller = person if method in ("Forget", "GetMemoryStats") else agent_member
            details = await refused(
                getattr(running.stub, method)(request, metadata=as_member(caller)),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert reason in details, (method, details)
    finally:
        await stop_memory(running)


async def test_members_are_who_the_im_says(im: RunningIM, database_url: str, tmp_path: Path) -> None:
    url = await migrated_url("sqlite" if database_url.startswith("sqlite") else "postgresql", tmp_path)
    world = await make_world(im.stub, people=3, kinds={1: im_pb2.MEMBER_KIND_AGENT})
    stranger = await make_world(im.stub, people=1)
    directory = GrpcMemberDirectory(im.address, service_secret=lambda: service_secret("memory"))
    running = await start_memory(url, directory=directory)
    try:
        agent_member, person = world.members[1].id, world.members[2].id
        run = RunBuilder(world.workspace.id, str(uuid.uuid4()), agent_member)
        run.user("the launch is on monday", group="g", members=[person])
        await archive(running, run.build())
        request = pb.RetrieveRequest(workspace=pb.WorkspaceScope(), query="launch monday")
        assert await texts(running, person, request) == ["the launch is on monday"]
        assert await texts(running, world.members[0].id, request) == []
        await refused(
            running.stub.Retrieve(
                pb.RetrieveRequest(
                    workspace=pb.WorkspaceScope(workspace_id=world.workspace.id), query="launch"
                ),
                metadata=as_member(stranger.members[0].id),
            ),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        wrong_workspace = RunBuilder(stranger.workspace.id, str(uuid.uuid4()), agent_member).user("x").build()
        await refused(
            running.stub.ArchiveRun(
                pb.ArchiveRunRequest(run=wrong_workspace), metadata=as_member(agent_member)
            ),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    finally:
        await stop_memory(running)

"""The memory service over gRPC, on SQLite and PostgreSQL: archive, retrieve, expand, forget, stats."""

# Chinese text is written with its own (full-width) punctuation.
# ruff: noqa: RUF001

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import grpc
import pytest

from agentim.memory.v1 import memory_pb2 as pb
from tests.identities import as_member
from tests.integration.memory_harness import (
    WITH_PGVECTOR,
    RunningMemory,
    memory,
    memory_url,
    start_memory,
    stop_memory,
)
from tests.memory_support import START, FixedDictionary, RunBuilder, stamp

__all__ = ["memory", "memory_url"]


def agent_scope(agent_id: str, *audience: str) -> pb.AgentScope:
    return pb.AgentScope(agent_id=agent_id, audience_member_ids=list(audience))


async def archive(memory: RunningMemory, run: pb.ArchivedRun) -> pb.ArchiveRunResponse:
    response: pb.ArchiveRunResponse = await memory.stub.ArchiveRun(
        pb.ArchiveRunRequest(run=run), metadata=as_member(run.agent_member_id)
    )
    return response


async def recall(
    memory: RunningMemory, member: str, agent_id: str, query: str, *audience: str, **options: object
) -> list[pb.RetrievedSegment]:
    response = await memory.stub.Retrieve(
        pb.RetrieveRequest(agent=agent_scope(agent_id, *audience), query=query, **options),  # type: ignore[arg-type]
        metadata=as_member(member),
    )
    return list(response.results)


async def embedded(memory: RunningMemory) -> None:
    assert memory.app.worker is not None
    await asyncio.wait_for(memory.app.worker.drained(), 10)


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_archive_is_idempotent_and_a_changed_run_replaces_its_segments(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    person = memory.directory.add(workspace)
    run = RunBuilder(workspace, agent, agent_member)
    run.user("the deploy of billing failed with ERR_QUOTA_42", group="g1", members=[person])
    run.assistant("I will raise the quota", reasoning="quota errors need a bigger limit", group="g1")
    first = await archive(memory, run.build())
    assert (first.segment_count, first.changed) == (3, True)
    again = await archive(memory, run.build())
    assert (again.segment_count, again.changed) == (3, False)

    run.steps[1].content = "I will ask ops to raise the quota"
    replaced = await archive(memory, run.build())
    assert (replaced.segment_count, replaced.changed) == (3, True)
    hits = await recall(memory, agent_member, agent, "raise the quota")
    texts = [hit.segment.text for hit in hits]
    assert "I will ask ops to raise the quota" in texts and "I will raise the quota" not in texts
    stats = await memory.stub.GetMemoryStats(
        pb.GetMemoryStatsRequest(agent_id=agent), metadata=as_member(person)
    )
    assert (stats.run_count, stats.segment_count) == (1, 3)


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_retrieve_finds_an_identifier_and_chinese_and_anchors_the_hit(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    run = RunBuilder(workspace, agent, agent_member)
    run.user("预算改成了五万元")
    run.assistant("noted", tool_calls=[("deploy", '{"service": "billing"}')])
    run.step(pb.STEP_ROLE_TOOL, "deploy failed: ERR_QUOTA_42 in services/billing/app.py", tool_name="deploy")
    await archive(memory, run.build())
    await embedded(memory)

    hits = await recall(memory, agent_member, agent, "err_quota_42")
    assert hits[0].segment.type == pb.SEGMENT_TYPE_TOOL_RESULT
    assert hits[0].segment.tool_name == "deploy"
    assert hits[0].segment.ref == f"{run.run_id}/3/0"
    assert hits[0].segment.anchor.session_id == run.session_id
    chinese = await recall(memory, agent_member, agent, "预算是多少")
    assert chinese[0].segment.text == "预算改成了五万元"
    calls = await recall(
        memory, agent_member, agent, "billing", filters=pb.RetrieveFilters(types=[pb.SEGMENT_TYPE_TOOL_CALL])
    )
    assert [hit.segment.type for hit in calls] == [pb.SEGMENT_TYPE_TOOL_CALL]
    assert calls[0].segment.text.startswith("deploy ")


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_filters_and_recency(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    old = RunBuilder(workspace, agent, agent_member, start=START)
    old.user("the budget is 40k")
    new = RunBuilder(workspace, agent, agent_member, start=START + timedelta(days=3))
    new.user("the budget is 50k")
    for run in (old, new):
        await archive(memory, run.build())
    await embedded(memory)
    recent = await recall(memory, agent_member, agent, "the budget", prefer_recent=True)
    # Numbers fold in the near-duplicate key: one result, one duplicate.
    assert len(recent) == 1 and recent[0].duplicates == 1
    assert recent[0].segment.text == "the budget is 50k"
    since = await recall(
        memory,
        agent_member,
        agent,
        "budget",
        filters=pb.RetrieveFilters(until=stamp(START + timedelta(days=1))),
    )
    assert [hit.segment.text for hit in since] == ["the budget is 40k"]
    excluded = await recall(
        memory, agent_member, agent, "budget", filters=pb.RetrieveFilters(exclude_run_ids=[new.run_id])
    )
    assert [hit.segment.text for hit in excluded] == ["the budget is 40k"]


async def test_expand_returns_the_neighbours_and_the_run(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    run = RunBuilder(workspace, agent, agent_member)
    for index in range(8):
        run.user(f"message number {index} about topic {index}")
    await archive(memory, run.build())
    expanded = await memory.stub.Expand(
        pb.ExpandRequest(agent=agent_scope(agent), ref=f"{run.run_id}/4/0", before=2),
        metadata=as_member(agent_member),
    )
    assert expanded.focus.text == "message number 3 about topic 3"
    assert [s.anchor.step_sequence for s in expanded.before] == [2, 3]
    assert [s.anchor.step_sequence for s in expanded.after] == [5, 6, 7]
    assert expanded.run.run_id == run.run_id and expanded.run.segment_count == 8
    for ref in (f"{run.run_id}/99/0", f"{uuid.uuid4()}/1/0"):
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await memory.stub.Expand(
                pb.ExpandRequest(agent=agent_scope(agent), ref=ref), metadata=as_member(agent_member)
            )
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_forget_removes_segments_from_every_index(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    # Forgetting is its owner's (or an admin's, or the runtime's) to do.
    person = memory.directory.owner_of(agent_member)
    keep = RunBuilder(workspace, agent, agent_member)
    keep.user("the staging password rotates monthly")
    drop = RunBuilder(workspace, agent, agent_member)
    drop.user("the production password rotates weekly")
    for run in (keep, drop):
        await archive(memory, run.build())
    await embedded(memory)
    assert len(await recall(memory, agent_member, agent, "password rotates")) == 2
    forgotten = await memory.stub.Forget(pb.ForgetRequest(run_id=drop.run_id), metadata=as_member(person))
    assert forgotten.deleted_segments == 1
    hits = await recall(memory, agent_member, agent, "production password weekly")
    assert [hit.segment.anchor.run_id for hit in hits] == [keep.run_id]
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await memory.stub.Expand(
            pb.ExpandRequest(agent=agent_scope(agent), ref=f"{drop.run_id}/1/0"),
            metadata=as_member(agent_member),
        )
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    forgotten = await memory.stub.Forget(pb.ForgetRequest(agent_id=agent), metadata=as_member(person))
    assert forgotten.deleted_segments == 1
    assert await recall(memory, agent_member, agent, "password") == []
    stats = await memory.stub.GetMemoryStats(
        pb.GetMemoryStatsRequest(workspace_id=workspace), metadata=as_member(person)
    )
    assert (stats.run_count, stats.segment_count) == (0, 0)


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_background_embedding_makes_a_segment_findable_by_meaning(memory_url: str) -> None:
    running = await start_memory(memory_url)
    try:
        # "automobile" shares no term with "car" but borrows its meaning.
        running.embedder.synonyms["automobile"] = "car"
        workspace, agent, agent_member = running.new_workspace()
        run = RunBuilder(workspace, agent, agent_member)
        run.user("my car is parked on level three")
        run.user("lunch is at noon")
        await archive(running, run.build())
        await embedded(running)
        hits = await recall(running, agent_member, agent, "where is the automobile")
        assert hits[0].segment.text == "my car is parked on level three"
        response = await running.stub.Retrieve(
            pb.RetrieveRequest(agent=agent_scope(agent), query="automobile"), metadata=as_member(agent_member)
        )
        assert response.pending_embeddings == 0
    finally:
        await stop_memory(running)


async def test_a_down_embedder_leaves_lexical_search_working(memory_url: str) -> None:
    running = await start_memory(memory_url)
    try:
        running.embedder.fail = True
        workspace, agent, agent_member = running.new_workspace()
        run = RunBuilder(workspace, agent, agent_member)
        run.user("the invoice number is INV-2291")
        await archive(running, run.build())
        response = await running.stub.Retrieve(
            pb.RetrieveRequest(agent=agent_scope(agent), query="INV-2291"), metadata=as_member(agent_member)
        )
        assert response.results[0].segment.text == "the invoice number is INV-2291"
        assert response.pending_embeddings == 1
        running.embedder.fail = False
        assert running.app.worker is not None
        running.app.worker.wake()
        await embedded(running)
        stats = await running.stub.GetMemoryStats(
            pb.GetMemoryStatsRequest(agent_id=agent), metadata=as_member(running.directory.add(workspace))
        )
        assert stats.pending_embeddings == 0
    finally:
        await stop_memory(running)


async def test_a_question_finds_the_fact_told_in_the_other_language_through_the_store(
    memory_url: str,
) -> None:
    running = await start_memory(memory_url, dictionary=FixedDictionary())
    try:
        workspace, agent, agent_member = running.new_workspace()
        run = RunBuilder(workspace, agent, agent_member)
        run.user("The ledger deploy on Monday failed because the cache ran out of memory.")
        run.user("ledger的文档修复已经合并了。")
        for index in range(6):
            run.user(f"ledger的站会改到十点半了，第{index}次。")
        await archive(running, run.build())
        # The fake embedder knows no Chinese: only the translated terms (deploy,
        # failed) find the English fact, through each backend's lexical index.
        found = await recall(running, agent_member, agent, "ledger的部署为什么失败了？", limit=3)
        assert found[0].segment.text.startswith("The ledger deploy on Monday failed")
    finally:
        await stop_memory(running)


async def test_prefer_recent_gives_the_newest_statement_of_a_fact_first(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    for month, person in enumerate(["Ada", "Finn", "Gus"]):
        run = RunBuilder(workspace, agent, agent_member, start=START + timedelta(days=30 * month))
        run.user(f"{person} is on call for billing from now on.")
        run.user(f"standup notes {month}: nothing about billing")
        await archive(memory, run.build())
    await embedded(memory)
    question = "who is on call for billing?"
    found = await recall(memory, agent_member, agent, question, limit=3, prefer_recent=True)
    assert [hit.segment.text for hit in found] == [
        "Gus is on call for billing from now on.",
        "Finn is on call for billing from now on.",
        "Ada is on call for billing from now on.",
    ]

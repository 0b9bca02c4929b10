"""The runtime's audit log, agents' owners in the IM, and the agents' quota,
over real gRPC with a real IM (SQLite and PostgreSQL) and real tokens."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf import field_mask_pb2

from agentim.audit.v1 import audit_pb2
from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.identity import VIEW_AS_KEY
from services.im.adapters.tables import members
from services.runtime.adapters.tables import audit_events
from services.runtime.domain.commands import TellAgentOwners
from tests.conftest import RunningIM
from tests.integration.test_quotas_grpc import quota_failure
from tests.integration.test_runtime_access import Team, make_team
from tests.integration.test_runtime_grpc import WAIT, RunningRuntime, start_runtime, stop_runtime

Metadata = tuple[tuple[str, str], ...]
SECRET_URL = "http://127.0.0.1:9/v1?api_key=ALSO-SECRET"
# Refused (credentials in a URL), and the refusal recorded without them.
CREDENTIALS_URL = "http://bot:sk-VERY-SECRET@127.0.0.1:9/v1"


@pytest.fixture
async def rt(im: RunningIM, tmp_path: Path) -> AsyncIterator[RunningRuntime]:
    running = await start_runtime(im.address, tmp_path / "runtime.db", RUNTIME_LLM_ALLOWED_HOSTS="127.0.0.1")
    yield running
    await stop_runtime(running)


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def log_of(rt: RunningRuntime, md: Metadata, **query: Any) -> list[audit_pb2.AuditEvent]:
    events: list[audit_pb2.AuditEvent] = []
    token = ""
    while True:
        page = await rt.stub.ListAuditEvents(
            rpb.ListAuditEventsRequest(page_size=7, page_token=token, query=audit_pb2.AuditQuery(**query)),
            metadata=md,
        )
        events.extend(page.audit_events)
        token = page.next_page_token
        if not token:
            return events


def only(events: Sequence[audit_pb2.AuditEvent], action: str) -> audit_pb2.AuditEvent:
    found = [e for e in events if e.action == action]
    assert len(found) == 1, f"{action}: {len(found)} records"
    return found[0]


async def settled(rt: RunningRuntime, agent_id: str) -> None:
    runner = rt.app.runner(uuid.UUID(agent_id))
    assert runner is not None
    await asyncio.sleep(0.05)
    await asyncio.wait_for(runner.idle.wait(), WAIT)


async def answered(im: RunningIM, rt: RunningRuntime, team: Team, who: str, agent: rpb.Agent) -> str:
    """A direct chat of `who` with the agent, once the agent answered in it."""
    chat = (
        await im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=team.md(who)
        )
    ).group
    await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=chat.id, content="hello"), metadata=team.md(who)
    )

    async def answer() -> None:
        while True:
            page = await im.stub.ListMessages(
                im_pb2.ListMessagesRequest(group_id=chat.id), metadata=team.md(who)
            )
            if len(page.messages) >= 2:
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(answer(), WAIT)
    await settled(rt, agent.id)
    return chat.id


async def test_each_action_on_an_agent_leaves_one_record(im: RunningIM, rt: RunningRuntime) -> None:
    team = await make_team(im)
    stub = rt.stub
    cyd = team.md("cyd")
    agent = (
        await stub.CreateAgent(rpb.CreateAgentRequest(name="helper", request_id="make-helper"), metadata=cyd)
    ).agent
    a = agent.id
    await answered(im, rt, team, "cyd", agent)
    await stub.UpdateAgent(
        rpb.UpdateAgentRequest(
            agent=rpb.Agent(id=a, system_prompt="Be terse."),
            update_mask=field_mask_pb2.FieldMask(paths=["system_prompt"]),
        ),
        metadata=cyd,
    )
    await stub.PauseAgent(rpb.PauseAgentRequest(agent_id=a), metadata=cyd)
    checkpoint = (
        await stub.CreateCheckpoint(rpb.CreateCheckpointRequest(agent_id=a, name="before"), metadata=cyd)
    ).checkpoint
    await stub.UpdateStep(rpb.UpdateStepRequest(agent_id=a, sequence=1, content="hello there"), metadata=cyd)
    await stub.AddNote(
        rpb.AddNoteRequest(agent_id=a, role=rpb.STEP_ROLE_USER, content="and be brief"), metadata=cyd
    )
    await stub.DeleteStep(rpb.DeleteStepRequest(agent_id=a, sequence=3), metadata=cyd)
    task = (await stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=a, input="sum it up"), metadata=cyd)).task
    await stub.CancelTask(rpb.CancelTaskRequest(task_id=task.id), metadata=cyd)
    await stub.RestoreCheckpoint(
        rpb.RestoreCheckpointRequest(agent_id=a, checkpoint_id=checkpoint.id), metadata=cyd
    )
    await stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=a), metadata=cyd)
    await settled(rt, a)
    await stub.RetryFromStep(rpb.RetryFromStepRequest(agent_id=a, sequence=2), metadata=cyd)
    await settled(rt, a)
    forked = await stub.ForkFromStep(rpb.ForkFromStepRequest(agent_id=a, sequence=1), metadata=cyd)
    await settled(rt, a)
    first_session = agent.main_session_id
    await stub.SetMainSession(rpb.SetMainSessionRequest(agent_id=a, session_id=first_session), metadata=cyd)
    await stub.TerminateAgent(rpb.TerminateAgentRequest(agent_id=a), metadata=cyd)
    await stub.StartAgent(rpb.StartAgentRequest(agent_id=a), metadata=cyd)
    await stub.DeleteAgent(rpb.DeleteAgentRequest(agent_id=a), metadata=cyd)

    events = await log_of(rt, team.md("ada"))
    assert {e.service for e in events} == {"runtime"}
    assert {e.workspace_id for e in events} == {team.workspace}
    assert {e.actor.member_id for e in events} == {team.id("cyd")}
    assert all(e.outcome.code == "OK" and e.count == 1 for e in events)
    actions = [e.action for e in events]
    assert sorted(actions) == sorted(
        [
            "CreateAgent",
            "UpdateAgent",
            "PauseAgent",
            "CreateCheckpoint",
            "UpdateStep",
            "AddNote",
            "DeleteStep",
            "SubmitTask",
            "CancelTask",
            "RestoreCheckpoint",
            "ResumeAgent",
            "RetryFromStep",
            "ForkFromStep",
            "SetMainSession",
            "TerminateAgent",
            "StartAgent",
            "DeleteAgent",
        ]
    )
    created = only(events, "CreateAgent")
    assert (created.target.kind, created.target.id, created.request_id) == ("agent", a, "make-helper")
    update = only(events, "UpdateAgent")
    assert (update.target.id, update.details["fields"], update.details["changed"]) == (
        a,
        "system_prompt",
        "system_prompt",
    )
    assert "Be terse" not in json.dumps(dict(update.details))
    assert only(events, "UpdateStep").details["sequence"] == "1"
    assert only(events, "DeleteStep").details["sequences"] == "3"
    assert only(events, "CreateCheckpoint").target.id == checkpoint.id
    assert only(events, "RestoreCheckpoint").details["checkpoint_id"] == checkpoint.id
    assert only(events, "SubmitTask").target.id == task.id
    assert only(events, "CancelTask").target.id == task.id
    assert only(events, "ForkFromStep").target.id == forked.session.id
    assert only(events, "SetMainSession").target.id == first_session
    assert only(events, "DeleteAgent").target.id == a
    # Filters: by action, and by target.
    assert [e.action for e in await log_of(rt, team.md("bea"), action="PauseAgent")] == ["PauseAgent"]
    assert {e.target.id for e in await log_of(rt, team.md("ada"), target_id=task.id)} == {task.id}


async def test_refusals_admins_only_and_no_secrets(im: RunningIM, rt: RunningRuntime) -> None:
    team = await make_team(im)
    other = await make_team(im)
    stub = rt.stub
    # An admin points an agent at a model endpoint whose URL holds credentials.
    agent = (
        await stub.CreateAgent(
            rpb.CreateAgentRequest(name="remote", model=rpb.ModelSettings(model="m-1", base_url=SECRET_URL)),
            metadata=team.md("bea"),
        )
    ).agent
    await stub.UpdateAgent(
        rpb.UpdateAgentRequest(
            agent=rpb.Agent(id=agent.id, model=rpb.ModelSettings(model="m-2", base_url=SECRET_URL + "&x=1")),
            update_mask=field_mask_pb2.FieldMask(paths=["model"]),
        ),
        metadata=team.md("bea"),
    )
    bad = await refusal(
        stub.UpdateAgent(
            rpb.UpdateAgentRequest(
                agent=rpb.Agent(id=agent.id, model=rpb.ModelSettings(base_url=CREDENTIALS_URL)),
                update_mask=field_mask_pb2.FieldMask(paths=["model"]),
            ),
            metadata=team.md("bea"),
        )
    )
    assert bad.code() is grpc.StatusCode.INVALID_ARGUMENT
    # A member who does not own it is refused, each time; the refusals are counted in one record.
    for _ in range(2):
        error = await refusal(
            stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=team.md("dan"))
        )
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    await refusal(stub.DeleteAgent(rpb.DeleteAgentRequest(agent_id=agent.id), metadata=team.md("dan")))
    # Another workspace's agent is not found (and recorded in the caller's workspace only).
    await refusal(stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=other.md("ada")))
    await stub.CreateAgent(rpb.CreateAgentRequest(name="theirs"), metadata=other.md("cyd"))

    denied = await refusal(stub.ListAuditEvents(rpb.ListAuditEventsRequest(), metadata=team.md("cyd")))
    assert denied.code() is grpc.StatusCode.PERMISSION_DENIED
    events = await log_of(rt, team.md("ada"))
    assert {e.workspace_id for e in events} == {team.workspace}
    refused = await log_of(rt, team.md("ada"), outcome=audit_pb2.AUDIT_OUTCOME_FILTER_REFUSED)
    pause = only(refused, "PauseAgent")
    assert (pause.actor.member_id, pause.target.id, pause.outcome.code, pause.count) == (
        team.id("dan"),
        agent.id,
        "PERMISSION_DENIED",
        2,
    )
    assert only(refused, "DeleteAgent").count == 1
    invalid = only(refused, "UpdateAgent")
    assert (invalid.actor.member_id, invalid.outcome.code) == (team.id("bea"), "INVALID_ARGUMENT")
    update = only([e for e in events if e.outcome.code == "OK"], "UpdateAgent")
    assert (update.details["changed"], update.details["model"], update.details["base_url_host"]) == (
        "model",
        "m-2",
        "127.0.0.1",
    )
    theirs = await log_of(rt, other.md("ada"))
    assert {e.action for e in theirs} == {"CreateAgent", "PauseAgent"}
    assert {e.workspace_id for e in theirs} == {other.workspace}
    assert only(theirs, "PauseAgent").outcome.code == "NOT_FOUND"

    database = rt.app.database
    assert database is not None
    async with database.engine.connect() as conn:
        rows = (await conn.execute(sa.select(audit_events))).all()
    text = json.dumps([[str(v) for v in row] for row in rows])
    for secret in ("VERY-SECRET", "ALSO-SECRET", "sk-", "api_key"):
        assert secret not in text


def view_as(md: Metadata, agent_member: str) -> Metadata:
    return (*md, (VIEW_AS_KEY, agent_member))


async def test_an_agents_owner_views_as_it_and_no_other_member_does(
    im: RunningIM, rt: RunningRuntime
) -> None:
    team = await make_team(im)
    agent = (await rt.stub.CreateAgent(rpb.CreateAgentRequest(name="mine"), metadata=team.md("cyd"))).agent
    chat = await answered(im, rt, team, "cyd", agent)
    member = (
        await im.stub.GetMember(im_pb2.GetMemberRequest(member_id=agent.member_id), metadata=team.md("dan"))
    ).member
    assert member.owner_id == team.id("cyd")

    as_agent = view_as(team.md("cyd"), agent.member_id)
    chats = await im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=as_agent)
    assert [c.group.id for c in chats.chats] == [chat]
    messages = await im.stub.ListMessages(im_pb2.ListMessagesRequest(group_id=chat), metadata=as_agent)
    assert len(messages.messages) >= 2
    # Reads only: a write through the view is refused, as the view of another member.
    write = await refusal(
        im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat, content="as the agent"), metadata=as_agent
        )
    )
    assert write.code() is grpc.StatusCode.PERMISSION_DENIED
    stranger = await refusal(
        im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=view_as(team.md("dan"), agent.member_id))
    )
    assert stranger.code() is grpc.StatusCode.PERMISSION_DENIED
    person = await refusal(
        im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=view_as(team.md("cyd"), team.id("dan")))
    )
    assert person.code() is grpc.StatusCode.PERMISSION_DENIED
    # The workspace's admins may, as before.
    await im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=view_as(team.md("bea"), agent.member_id))


async def test_the_runtime_tells_the_im_the_owners_of_older_agents_at_start(
    im: RunningIM, tmp_path: Path
) -> None:
    team = await make_team(im)
    first = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        agent = (
            await first.stub.CreateAgent(rpb.CreateAgentRequest(name="old"), metadata=team.md("cyd"))
        ).agent
    finally:
        await stop_runtime(first)
    # As an agent made before the IM knew owners.
    async with im.app.database.engine.begin() as conn:
        await conn.execute(
            members.update().where(members.c.id == uuid.UUID(agent.member_id)).values(owner_id=None)
        )
    as_agent = view_as(team.md("cyd"), agent.member_id)
    refused = await refusal(im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=as_agent))
    assert refused.code() is grpc.StatusCode.PERMISSION_DENIED
    again = await start_runtime(im.address, tmp_path / "runtime.db")
    try:

        async def owned() -> None:
            while True:
                found = await im.stub.GetMember(
                    im_pb2.GetMemberRequest(member_id=agent.member_id), metadata=team.md("cyd")
                )
                if found.member.owner_id == team.id("cyd"):
                    return
                await asyncio.sleep(0.02)

        await asyncio.wait_for(owned(), WAIT)
        await im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=as_agent)
        # Told once more (a restart), nothing changes.
        assert await again.app.bus.handle(TellAgentOwners()) == 0
    finally:
        await stop_runtime(again)


async def test_creating_agents_through_the_runtime_counts_against_the_quota(
    im_factory: Any, tmp_path: Path
) -> None:
    im = await im_factory(QUOTA_AGENTS_PER_WORKSPACE="1")
    team = await make_team(im)
    running = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        await running.stub.CreateAgent(rpb.CreateAgentRequest(name="one"), metadata=team.md("cyd"))
        error = await refusal(
            running.stub.CreateAgent(rpb.CreateAgentRequest(name="two"), metadata=team.md("dan"))
        )
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota of 1 agents" in (error.details() or "")
        assert quota_failure(error).violations[0].subject == "workspace:agents"
        listed = await running.stub.ListAgents(rpb.ListAgentsRequest(), metadata=team.md("ada"))
        assert [a.name for a in listed.agents] == ["one"]
    finally:
        await stop_runtime(running)

"""Who may do what to agents, with real access tokens from a real IM; model
endpoints only to allowed hosts; the runtime calls the IM with its own tokens."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.identity import bearer_metadata
from services.common.service_auth import TokenRefused
from services.common.tokens import PrincipalKind, Verifier
from services.runtime.adapters.im_client import GrpcIM
from tests.conftest import RunningIM
from tests.identities import as_member
from tests.integration.test_runtime_grpc import (
    RunningRuntime,
    start_runtime,
    stop_runtime,
    wait_for_messages,
)

PASSWORD = "correct horse battery"
WAIT = 10.0
Metadata = tuple[tuple[str, str], ...]


class Team:
    """A workspace with an owner (ada), an admin (bea) and two members (cyd, dan),
    each with an access token from the IM."""

    def __init__(self, workspace: str, people: dict[str, im_pb2.Tokens]) -> None:
        self.workspace = workspace
        self.people = people

    def md(self, name: str) -> Metadata:
        return bearer_metadata(self.people[name].access_token)

    def id(self, name: str) -> str:
        return self.people[name].member.id


async def make_team(im: RunningIM) -> Team:
    auth = auth_pb2_grpc.AuthServiceStub(im.channel)
    created = await im.stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(
            name=f"ws-{uuid.uuid4().hex[:6]}",
            creator_display_name="ada",
            creator_login="ada",
            creator_password=PASSWORD,
        )
    )
    people = {"ada": created.tokens}
    for name, role in (("bea", im_pb2.MEMBER_ROLE_ADMIN), ("cyd", None), ("dan", None)):
        invite = await auth.CreateInvite(
            auth_pb2.CreateInviteRequest(role=role) if role else auth_pb2.CreateInviteRequest(),
            metadata=bearer_metadata(created.tokens.access_token),
        )
        accepted = await auth.AcceptInvite(
            auth_pb2.AcceptInviteRequest(
                invite=invite.secret, display_name=name, login=name, password=PASSWORD
            )
        )
        people[name] = accepted.tokens
    return Team(created.workspace.id, people)


@pytest.fixture
async def runtime(im: RunningIM, tmp_path: Path) -> AsyncIterator[RunningRuntime]:
    running = await start_runtime(im.address, tmp_path / "runtime.db")
    yield running
    await stop_runtime(running)


async def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    code: grpc.StatusCode = caught.value.code()
    return code


async def first_of(stream: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(stream.read(), WAIT)
    code: grpc.StatusCode = caught.value.code()
    return code


async def test_members_see_agents_but_only_their_owner_and_admins_control_them(
    im: RunningIM, runtime: RunningRuntime
) -> None:
    team = await make_team(im)
    stub = runtime.stub
    made = (await stub.CreateAgent(rpb.CreateAgentRequest(name="helper"), metadata=team.md("cyd"))).agent
    assert made.owner_id == team.id("cyd")
    agent = made.id
    # Every member sees it, its owner included.
    seen = await stub.GetAgent(rpb.GetAgentRequest(agent_id=agent), metadata=team.md("dan"))
    assert seen.agent.owner_id == team.id("cyd")
    listed = await stub.ListAgents(rpb.ListAgentsRequest(), metadata=team.md("dan"))
    assert [a.id for a in listed.agents] == [agent]

    def controls(md: Metadata) -> list[Any]:
        return [
            stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent), metadata=md),
            stub.ListSteps(rpb.ListStepsRequest(agent_id=agent), metadata=md),
            stub.ListRuns(rpb.ListRunsRequest(agent_id=agent), metadata=md),
            stub.ListSessions(rpb.ListSessionsRequest(agent_id=agent), metadata=md),
            stub.ListCheckpoints(rpb.ListCheckpointsRequest(agent_id=agent), metadata=md),
            stub.ListTasks(rpb.ListTasksRequest(agent_id=agent), metadata=md),
            stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=agent, input="do it"), metadata=md),
            stub.WakeAgent(rpb.WakeAgentRequest(agent_id=agent), metadata=md),
            stub.UpdateAgent(
                rpb.UpdateAgentRequest(
                    agent=rpb.Agent(id=agent, role="spy"),
                    update_mask=field_mask_pb2.FieldMask(paths=["role"]),
                ),
                metadata=md,
            ),
            stub.DeleteAgent(rpb.DeleteAgentRequest(agent_id=agent), metadata=md),
        ]

    # Another member may do none of it.
    for call in controls(team.md("dan")):
        assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED
    assert (
        await first_of(stub.WatchAgent(rpb.WatchAgentRequest(agent_id=agent), metadata=team.md("dan")))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    # Another workspace's owner does not even see it.
    stranger = await make_team(im)
    assert (
        await code_of(stub.GetAgent(rpb.GetAgentRequest(agent_id=agent), metadata=stranger.md("ada")))
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        await code_of(stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent), metadata=stranger.md("ada")))
        == grpc.StatusCode.NOT_FOUND
    )
    # Its owner, an admin and the workspace's owner may.
    paused = await stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent), metadata=team.md("cyd"))
    assert paused.agent.state == rpb.AGENT_STATE_PAUSED
    await stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=agent), metadata=team.md("bea"))
    await stub.ListSteps(rpb.ListStepsRequest(agent_id=agent), metadata=team.md("ada"))
    task = await stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=agent, input="hi"), metadata=team.md("cyd"))
    assert (
        await code_of(stub.GetTask(rpb.GetTaskRequest(task_id=task.task.id), metadata=team.md("dan")))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    await stub.GetTask(rpb.GetTaskRequest(task_id=task.task.id), metadata=team.md("bea"))
    await stub.DeleteAgent(rpb.DeleteAgentRequest(agent_id=agent), metadata=team.md("bea"))


async def test_a_member_watching_the_workspace_sees_others_agents_change_state_but_not_their_work(
    im: RunningIM, runtime: RunningRuntime
) -> None:
    team = await make_team(im)
    stub = runtime.stub
    agent = (await stub.CreateAgent(rpb.CreateAgentRequest(name="helper"), metadata=team.md("cyd"))).agent
    owners = stub.WatchAgents(rpb.WatchAgentsRequest(), metadata=team.md("cyd"))
    others = stub.WatchAgents(rpb.WatchAgentsRequest(), metadata=team.md("dan"))
    for stream in (owners, others):
        await asyncio.wait_for(stream.wait_for_connection(), WAIT)
    await stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=agent.id, input="hello"), metadata=team.md("cyd"))

    async def kinds_until_idle(stream: Any) -> list[str]:
        kinds: list[str] = []
        while True:
            event = (await asyncio.wait_for(stream.read(), WAIT)).event
            kinds.append(event.WhichOneof("event"))
            if kinds[-1] == "state_changed" and event.state_changed.state == rpb.AGENT_STATE_IDLE:
                return kinds

    seen_by_owner = await kinds_until_idle(owners)
    seen_by_others = await kinds_until_idle(others)
    assert "step_completed" in seen_by_owner and "run_started" in seen_by_owner
    assert set(seen_by_others) == {"state_changed"}
    owners.cancel()
    others.cancel()


async def test_only_admins_set_a_model_endpoint_and_only_to_allowed_hosts(
    im: RunningIM, tmp_path: Path
) -> None:
    runtime = await start_runtime(
        im.address, tmp_path / "runtime.db", RUNTIME_LLM_ALLOWED_HOSTS="llm.example.com,localhost"
    )
    try:
        team = await make_team(im)
        stub = runtime.stub

        def model(url: str) -> rpb.ModelSettings:
            return rpb.ModelSettings(model="m", base_url=url)

        async def create(who: str, url: str) -> grpc.StatusCode:
            request = rpb.CreateAgentRequest(name="a", model=model(url))
            return await code_of(stub.CreateAgent(request, metadata=team.md(who)))

        # A member may not point an agent anywhere, not even at an allowed host.
        assert await create("cyd", "http://llm.example.com/v1") == grpc.StatusCode.PERMISSION_DENIED
        own = (await stub.CreateAgent(rpb.CreateAgentRequest(name="mine"), metadata=team.md("cyd"))).agent
        change = rpb.UpdateAgentRequest(
            agent=rpb.Agent(id=own.id, model=model("http://llm.example.com/v1")),
            update_mask=field_mask_pb2.FieldMask(paths=["model"]),
        )
        assert (
            await code_of(stub.UpdateAgent(change, metadata=team.md("cyd")))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        # Other model settings stay the owner's to change.
        change.agent.model.base_url = ""
        await stub.UpdateAgent(change, metadata=team.md("cyd"))
        # An admin may not reach loopback, by address or by a name resolving to it, unless listed.
        for url in (
            "http://127.0.0.1:9/v1",
            "http://[::1]:9/v1",
            "http://localhost:9/v1",
            "http://evil.test/v1",
        ):
            assert await create("bea", url) == grpc.StatusCode.INVALID_ARGUMENT, url
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateAgent(
                rpb.CreateAgentRequest(name="a", model=model("http://localhost:9/v1")),
                metadata=team.md("ada"),
            )
        assert "RUNTIME_LLM_ALLOWED_HOSTS" in (refused.value.details() or "")
    finally:
        await stop_runtime(runtime)
    # Listed with its address, loopback is allowed.
    listed = await start_runtime(
        im.address, tmp_path / "listed.db", RUNTIME_LLM_ALLOWED_HOSTS="localhost,127.0.0.1,::1"
    )
    try:
        made = await listed.stub.CreateAgent(
            rpb.CreateAgentRequest(name="local", model=model("http://localhost:9/v1")),
            metadata=team.md("bea"),
        )
        assert made.agent.model.base_url == "http://localhost:9/v1"
    finally:
        await stop_runtime(listed)


async def test_the_runtime_answers_as_the_agent_with_the_agents_own_token(
    im: RunningIM, runtime: RunningRuntime
) -> None:
    team = await make_team(im)
    agent = (
        await runtime.stub.CreateAgent(rpb.CreateAgentRequest(name="ada-bot"), metadata=team.md("cyd"))
    ).agent
    chat = await im.stub.CreateGroup(
        im_pb2.CreateGroupRequest(name="pair", member_ids=[agent.member_id]),
        metadata=as_member(team.id("cyd")),
    )
    await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=chat.group.id, content="hello there"),
        metadata=as_member(team.id("cyd")),
    )
    messages = await wait_for_messages(im, team.id("cyd"), chat.group.id, 2)
    assert messages[1].sender_id == agent.member_id
    client = runtime.app.im
    assert isinstance(client, GrpcIM)
    tokens = client.agent_tokens
    assert tokens is not None
    held = tokens.held(uuid.UUID(agent.member_id))
    assert held is not None
    auth = client.auth
    claims = await Verifier(auth.signing_keys).verify(held)
    assert (claims.kind, str(claims.member_id), claims.host) == (
        PrincipalKind.AGENT,
        agent.member_id,
        "runtime",
    )


async def test_the_runtime_gets_no_token_for_a_person_or_an_agent_it_does_not_host(
    im: RunningIM, runtime: RunningRuntime
) -> None:
    team = await make_team(im)
    stray = await im.stub.CreateMember(
        im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_AGENT, display_name="stray"),
        metadata=as_member(team.id("ada")),
    )
    client = runtime.app.im
    assert isinstance(client, GrpcIM)
    tokens, service = client.agent_tokens, client.service_token
    assert tokens is not None and service is not None
    own = await service.get()
    assert own is not None
    for member in (team.id("cyd"), stray.member.id):
        with pytest.raises(TokenRefused):
            await client.auth.agent_tokens(own, [uuid.UUID(member)])
        assert await tokens.get(uuid.UUID(member)) is None

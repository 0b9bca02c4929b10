"""Every RuntimeService RPC, called by every kind of caller, over real gRPC.

For each RPC one valid request is built (about a fresh agent or task where
the call uses it up), and sent by: the workspace's owner, an admin, the
member who owns the agents the requests are about ("member"), another member
of the workspace ("outsider": they own none of them), a person of another
workspace, the workspace owner's read-only personal access token, an agent
of the workspace (its IM token), the runtime's and the memory service's own
tokens, no token, an expired token and a tampered one.
The status each gets is compared with the expected one: derived from the
RPC's `Rule` in `services/runtime/entrypoints/policy.py` (people only, and
UNAUTHENTICATED for bad credentials), then from the runtime's resource rules
written below (`RESOURCE`, after `services/runtime/domain/access.py` and
docs/security.md, "Who may do what": members see a workspace's agents; an
agent's owner and the workspace's admins and owner control it and read its
work; another workspace's agent does not exist).

One IM and one runtime on SQLite serve the whole module, with a fake model
server that answers at once, except a task saying "keep working" (its call
is held open: the agent stays RUNNING until interrupted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.identity import Caller, bearer_metadata
from services.common.tokens import KeyRing, Verifier, keyring_source
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.runtime.entrypoints.policy import RUNTIME_POLICY, RUNTIME_SERVICE
from tests.auth_support import auth_dir
from tests.authn_support import (
    BAD_CREDENTIALS,
    Cast,
    Metadata,
    claims_of,
    expected_status,
    expired_token,
    make_cast,
    read_only,
    tampered_token,
)
from tests.conftest import RunningIM, start_im, stop_im
from tests.fake_openai import FakeOpenAI, Received, Reply, chunk, text_reply
from tests.integration.test_runtime_grpc import RunningRuntime, start_runtime, stop_runtime

OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED

PEOPLE = ("owner", "admin", "member", "outsider", "stranger")
# "reader": the workspace owner's read-only personal access token (reads only).
CALLERS = (*PEOPLE, "reader", "agent", "runtime", "memory", "no token", "expired", "tampered")
# Long enough for a handler's answer on a busy machine, short enough for a
# stream that never answers to fail the test quickly.
WAIT = 10.0

# What the handlers decide once the rule let a caller through (OK unless named).
# The agents and tasks are of the cast's workspace, owned by "member";
# "stranger" is of another workspace, where none of it exists.
CONTROL = {"outsider": DENIED, "stranger": NOT_FOUND}
VIEW = {"stranger": NOT_FOUND}
# The stranger owns a workspace of its own: it reads that one's log and replicas.
ADMINS = {"member": DENIED, "outsider": DENIED}
RESOURCE: dict[str, dict[str, grpc.StatusCode]] = {
    # The request names the cast's workspace, which is not the stranger's.
    "CreateAgent": VIEW,
    "GetAgent": VIEW,
    "ListAgents": {},
    "UpdateAgent": CONTROL,
    "DeleteAgent": CONTROL,
    "WakeAgent": CONTROL,
    "ListRuns": CONTROL,
    "ListSteps": CONTROL,
    "WatchAgent": CONTROL,
    # Every member watches the workspace (the state changes of others' agents).
    "WatchAgents": VIEW,
    "StartAgent": CONTROL,
    "PauseAgent": CONTROL,
    "ResumeAgent": CONTROL,
    "InterruptAgent": CONTROL,
    "TerminateAgent": CONTROL,
    "UpdateStep": CONTROL,
    "DeleteStep": CONTROL,
    "AddNote": CONTROL,
    "CreateCheckpoint": CONTROL,
    "ListCheckpoints": CONTROL,
    "RestoreCheckpoint": CONTROL,
    "ListSessions": CONTROL,
    "SetMainSession": CONTROL,
    "RetryFromStep": CONTROL,
    "ForkFromStep": CONTROL,
    "SubmitTask": CONTROL,
    "GetTask": CONTROL,
    "ListTasks": CONTROL,
    "CancelTask": CONTROL,
    "GetQueueStats": CONTROL,
    "ListTools": {},
    "ListAuditEvents": ADMINS,
    "ListReplicas": ADMINS,
}


@dataclass
class Matrix:
    im: RunningIM
    runtime: RunningRuntime
    cast: Cast
    metadata: dict[str, Metadata]
    callers: dict[str, Caller]
    # Agents owned by the cast's member, shared by the calls that leave them as they were:
    # one that answered a task (its steps, run, task, a checkpoint), one paused with a
    # note (steps to edit), one tasks are submitted to, and one only paused and
    # resumed, for the workspace's watchers to see a change.
    worked: rpb.Agent = field(init=False)
    task: rpb.Task = field(init=False)
    paused: rpb.Agent = field(init=False)
    busy: rpb.Agent = field(init=False)
    pinged: rpb.Agent = field(init=False)

    @property
    def stub(self) -> Any:
        return self.runtime.stub


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    async def poll() -> None:
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), WAIT)


async def new_agent(m: Matrix, name: str = "helper") -> rpb.Agent:
    made: rpb.Agent = (
        await m.stub.CreateAgent(rpb.CreateAgentRequest(name=name), metadata=m.cast.member.md)
    ).agent
    return made


async def state_of(m: Matrix, agent: rpb.Agent) -> int:
    found = await m.stub.GetAgent(rpb.GetAgentRequest(agent_id=agent.id), metadata=m.cast.member.md)
    state: int = found.agent.state
    return state


async def paused_agent(m: Matrix, notes: int = 0) -> rpb.Agent:
    """A fresh agent, paused, with `notes` user steps."""
    agent = await new_agent(m)
    await m.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=m.cast.member.md)

    async def paused() -> bool:
        return await state_of(m, agent) == rpb.AGENT_STATE_PAUSED

    await until(paused)
    for n in range(notes):
        await m.stub.AddNote(
            rpb.AddNoteRequest(agent_id=agent.id, role=rpb.STEP_ROLE_USER, content=f"note {n}"),
            metadata=m.cast.member.md,
        )
    return agent


async def answered(m: Matrix, agent: rpb.Agent, text: str) -> rpb.Task:
    """A task the agent ran to its end."""
    md = m.cast.member.md
    task: rpb.Task = (
        await m.stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=agent.id, input=text), metadata=md)
    ).task

    async def done() -> bool:
        found = await m.stub.GetTask(rpb.GetTaskRequest(task_id=task.id), metadata=md)
        if found.task.status == rpb.TASK_STATUS_SUCCEEDED:
            return await state_of(m, agent) == rpb.AGENT_STATE_IDLE
        assert found.task.status in (rpb.TASK_STATUS_QUEUED, rpb.TASK_STATUS_RUNNING), found.task
        return False

    await until(done)
    return task


KEEP_WORKING = "keep working"


def _model_answer(request: Received) -> Reply:
    if KEEP_WORKING in str(request.body["messages"][-1].get("content")):
        return Reply(chunks=[chunk(role="assistant", content=""), chunk(content="Working")], hold=True)
    return text_reply("Done.")


@pytest.fixture(scope="module")
async def matrix(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory: Path = tmp_path_factory.mktemp("runtime-matrix")
    llm = FakeOpenAI()
    llm.responder = _model_answer
    await llm.start()
    url = f"sqlite:///{directory / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    # The runtime registers an agent member per agent: many, quickly.
    im = await start_im(url, LIMIT_CREATE_PER_SECOND="0")
    # Many agents and tasks for one member, quickly, are the matrix, not abuse.
    runtime = await start_runtime(
        im.address,
        directory / "runtime.db",
        OPENAI_BASE_URL=llm.url,
        OPENAI_MODEL="fake",
        LLM_MAX_RETRIES="0",
        LIMIT_CREATE_PER_SECOND="0",
    )
    try:
        cast = await make_cast(im)
        people = {name: getattr(cast, name) for name in (*PEOPLE, "agent")}
        metadata: dict[str, Metadata] = {name: person.md for name, person in people.items()}
        metadata |= {
            "reader": await read_only(im, cast.owner),
            "runtime": cast.runtime,
            "memory": cast.memory,
            "no token": (),
            "expired": bearer_metadata(expired_token(claims_of(cast.member, cast.workspace))),
            "tampered": bearer_metadata(tampered_token(cast.member.access_token)),
        }
        verifier = Verifier(keyring_source(KeyRing.load(auth_dir() / "keys")))
        callers = {
            name: Caller(claims=await verifier.verify(md[0][1].removeprefix("Bearer ")))
            for name, md in metadata.items()
            if name not in BAD_CREDENTIALS
        }
        m = Matrix(im, runtime, cast, metadata, callers)
        m.worked = await new_agent(m, "worker")
        m.task = await answered(m, m.worked, "hello")
        await m.stub.CreateCheckpoint(
            rpb.CreateCheckpointRequest(agent_id=m.worked.id, name="first"), metadata=cast.member.md
        )
        m.paused = await paused_agent(m, notes=1)
        m.busy = await new_agent(m, "busy")
        m.pinged = await new_agent(m, "pinged")
        yield m
    finally:
        await stop_runtime(runtime)
        await stop_im(im)
        await llm.stop()


def expected(method: str, caller: str, m: Matrix) -> grpc.StatusCode:
    return expected_status(
        RUNTIME_POLICY, f"/{RUNTIME_SERVICE}/{method}", caller, m.callers, RESOURCE[method]
    )


# -- one valid request per RPC, built fresh per call -----------------------------------

Build = Callable[[Matrix], Awaitable[Any]]


def fixed(make: Callable[[Matrix], Any]) -> Build:
    async def build(m: Matrix) -> Any:
        return make(m)

    return build


async def _delete(m: Matrix) -> Any:
    return rpb.DeleteAgentRequest(agent_id=(await new_agent(m)).id)


async def _start(m: Matrix) -> Any:
    agent = await new_agent(m)
    await m.stub.TerminateAgent(rpb.TerminateAgentRequest(agent_id=agent.id), metadata=m.cast.member.md)
    return rpb.StartAgentRequest(agent_id=agent.id)


async def _pause(m: Matrix) -> Any:
    return rpb.PauseAgentRequest(agent_id=(await new_agent(m)).id)


async def _resume(m: Matrix) -> Any:
    return rpb.ResumeAgentRequest(agent_id=(await paused_agent(m)).id)


async def _interrupt(m: Matrix) -> Any:
    # Only a RUNNING agent is interrupted: one whose model call is held open.
    agent = await new_agent(m)
    await m.stub.SubmitTask(
        rpb.SubmitTaskRequest(agent_id=agent.id, input=KEEP_WORKING), metadata=m.cast.member.md
    )

    async def running() -> bool:
        return await state_of(m, agent) == rpb.AGENT_STATE_RUNNING

    await until(running)
    return rpb.InterruptAgentRequest(agent_id=agent.id)


async def _terminate(m: Matrix) -> Any:
    return rpb.TerminateAgentRequest(agent_id=(await new_agent(m)).id)


async def _delete_step(m: Matrix) -> Any:
    return rpb.DeleteStepRequest(agent_id=(await paused_agent(m, notes=1)).id, sequence=1)


async def _restore(m: Matrix) -> Any:
    agent = await new_agent(m)
    made = await m.stub.CreateCheckpoint(
        rpb.CreateCheckpointRequest(agent_id=agent.id, name="before"), metadata=m.cast.member.md
    )
    await m.stub.UpdateAgent(
        rpb.UpdateAgentRequest(
            agent=rpb.Agent(id=agent.id, role="changed"),
            update_mask=field_mask_pb2.FieldMask(paths=["role"]),
        ),
        metadata=m.cast.member.md,
    )
    return rpb.RestoreCheckpointRequest(agent_id=agent.id, checkpoint_id=made.checkpoint.id)


async def _set_main_session(m: Matrix) -> Any:
    # A fork makes a new session the main one; the request makes the first one main again.
    agent = await paused_agent(m, notes=1)
    first = agent.main_session_id
    await m.stub.ForkFromStep(
        rpb.ForkFromStepRequest(agent_id=agent.id, sequence=1), metadata=m.cast.member.md
    )

    # The fork goes on from the note: it runs, and may change sessions only
    # when done. (Idle alone is not done: on a busy machine the agent is idle
    # for a moment after the fork, before its run begins.)
    async def settled() -> bool:
        runs = await m.stub.ListRuns(rpb.ListRunsRequest(agent_id=agent.id), metadata=m.cast.member.md)
        ended = bool(runs.runs) and all(r.status != rpb.RUN_STATUS_RUNNING for r in runs.runs)
        return ended and await state_of(m, agent) in (rpb.AGENT_STATE_IDLE, rpb.AGENT_STATE_PAUSED)

    await until(settled)
    return rpb.SetMainSessionRequest(agent_id=agent.id, session_id=first)


async def _retry(m: Matrix) -> Any:
    return rpb.RetryFromStepRequest(agent_id=(await paused_agent(m, notes=2)).id, sequence=2)


async def _fork(m: Matrix) -> Any:
    return rpb.ForkFromStepRequest(agent_id=(await paused_agent(m, notes=1)).id, sequence=1)


async def _cancel(m: Matrix) -> Any:
    # A task waits while its agent is paused.
    task = await m.stub.SubmitTask(
        rpb.SubmitTaskRequest(agent_id=m.paused.id, input="later"), metadata=m.cast.member.md
    )
    return rpb.CancelTaskRequest(task_id=task.task.id)


def _update_agent(m: Matrix) -> Any:
    return rpb.UpdateAgentRequest(
        agent=rpb.Agent(id=m.worked.id, role="helper"),
        update_mask=field_mask_pb2.FieldMask(paths=["role"]),
    )


REQUESTS: dict[str, Build] = {
    "CreateAgent": fixed(lambda m: rpb.CreateAgentRequest(name="new", workspace_id=m.cast.workspace.id)),
    "GetAgent": fixed(lambda m: rpb.GetAgentRequest(agent_id=m.worked.id)),
    "ListAgents": fixed(lambda m: rpb.ListAgentsRequest()),
    "UpdateAgent": fixed(_update_agent),
    "DeleteAgent": _delete,
    "WakeAgent": fixed(lambda m: rpb.WakeAgentRequest(agent_id=m.busy.id)),
    "ListRuns": fixed(lambda m: rpb.ListRunsRequest(agent_id=m.worked.id)),
    "ListSteps": fixed(lambda m: rpb.ListStepsRequest(agent_id=m.worked.id)),
    "WatchAgent": fixed(lambda m: rpb.WatchAgentRequest(agent_id=m.worked.id)),
    "WatchAgents": fixed(lambda m: rpb.WatchAgentsRequest(workspace_id=m.cast.workspace.id)),
    "StartAgent": _start,
    "PauseAgent": _pause,
    "ResumeAgent": _resume,
    "InterruptAgent": _interrupt,
    "TerminateAgent": _terminate,
    "UpdateStep": fixed(lambda m: rpb.UpdateStepRequest(agent_id=m.paused.id, sequence=1, content="edited")),
    "DeleteStep": _delete_step,
    "AddNote": fixed(
        lambda m: rpb.AddNoteRequest(agent_id=m.paused.id, role=rpb.STEP_ROLE_SYSTEM, content="be brief")
    ),
    "CreateCheckpoint": fixed(lambda m: rpb.CreateCheckpointRequest(agent_id=m.worked.id, name="now")),
    "ListCheckpoints": fixed(lambda m: rpb.ListCheckpointsRequest(agent_id=m.worked.id)),
    "RestoreCheckpoint": _restore,
    "ListSessions": fixed(lambda m: rpb.ListSessionsRequest(agent_id=m.worked.id)),
    "SetMainSession": _set_main_session,
    "RetryFromStep": _retry,
    "ForkFromStep": _fork,
    "SubmitTask": fixed(lambda m: rpb.SubmitTaskRequest(agent_id=m.busy.id, input="do it")),
    "GetTask": fixed(lambda m: rpb.GetTaskRequest(task_id=m.task.id)),
    "ListTasks": fixed(lambda m: rpb.ListTasksRequest(agent_id=m.worked.id)),
    "CancelTask": _cancel,
    "GetQueueStats": fixed(lambda m: rpb.GetQueueStatsRequest(agent_id=m.worked.id)),
    "ListTools": fixed(lambda m: rpb.ListToolsRequest()),
    "ListAuditEvents": fixed(lambda m: rpb.ListAuditEventsRequest()),
    "ListReplicas": fixed(lambda m: rpb.ListReplicasRequest()),
}


async def _first_event(m: Matrix, call: Any) -> grpc.StatusCode:
    """OK if the stream's first event comes, else the status it ended with.

    WatchAgent replays the worked agent's steps at once; WatchAgents is live
    only, so once the server answered (accepted or refused) a change of
    state of an idle agent gives every member's watch an event."""
    try:
        await asyncio.wait_for(call.initial_metadata(), WAIT)
        if not call.done():
            md = m.cast.owner.md
            await m.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=m.pinged.id), metadata=md)
            await m.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=m.pinged.id), metadata=md)
        await asyncio.wait_for(call.read(), WAIT)
    except grpc.aio.AioRpcError as error:
        return error.code()
    finally:
        call.cancel()
    return OK


async def status_of(m: Matrix, method: str, request: Any, metadata: Metadata) -> grpc.StatusCode:
    call = getattr(m.stub, method)(request, metadata=metadata, timeout=WAIT)
    if method in ("WatchAgent", "WatchAgents"):
        return await _first_event(m, call)
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return OK


def _cases() -> Iterator[Any]:
    for method in REQUESTS:
        yield pytest.param(method, id=method)


def test_every_rpc_of_the_runtime_has_a_request_and_a_resource_rule_here() -> None:
    served = {method for method in RUNTIME_POLICY if method.startswith(f"/{RUNTIME_SERVICE}/")}
    in_proto = {
        f"/{RUNTIME_SERVICE}/{m.name}" for m in rpb.DESCRIPTOR.services_by_name["RuntimeService"].methods
    }
    assert served == in_proto
    assert {f"/{RUNTIME_SERVICE}/{m}" for m in REQUESTS} == served
    assert {f"/{RUNTIME_SERVICE}/{m}" for m in RESOURCE} == served


@pytest.mark.parametrize("method", list(_cases()))
async def test_every_caller_gets_what_the_rules_say(matrix: Matrix, method: str) -> None:
    build = REQUESTS[method]
    got: dict[str, str] = {}
    want: dict[str, str] = {}
    for caller in CALLERS:
        request = await build(matrix)
        got[caller] = (await status_of(matrix, method, request, matrix.metadata[caller])).name
        want[caller] = expected(method, caller, matrix).name
    assert got == want


async def test_the_owner_of_an_agent_is_what_makes_a_member_control_it(matrix: Matrix) -> None:
    # The matrix's "outsider" is refused only because the agents are the member's:
    # an agent of its own it controls like the member does its.
    md = matrix.metadata["outsider"]
    own = (await matrix.stub.CreateAgent(rpb.CreateAgentRequest(name="own"), metadata=md)).agent
    steps = await matrix.stub.ListSteps(rpb.ListStepsRequest(agent_id=own.id), metadata=md)
    assert list(steps.steps) == []
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await matrix.stub.ListSteps(rpb.ListStepsRequest(agent_id=own.id), metadata=matrix.metadata["member"])
    assert refused.value.code() == DENIED

"""Every MemoryService RPC, called by every kind of caller, over real gRPC.

The callers are the runtime matrix's (`test_runtime_access_matrix.py`): the
workspace's owner, an admin, the member who owns the agent whose memory the
requests are about ("member"), another member of the workspace
("outsider"), a person of another workspace, the owner's read-only token,
the agent itself, the runtime's and the memory service's own tokens, no
token, an expired token and a tampered one. Every person of the workspace
is in the group the agent's archived run talked in, so that what a person
may find is decided by who they are, not by the audience rule
(`test_memory_isolation.py` covers that one).

The status each gets is compared with the expected one: derived from the
RPC's `Rule` in `services/memory/entrypoints/policy.py`, then from the
resource rules below (`RESOURCE`): another workspace's memory is refused;
an agent's archived runs are its own to write; a service acting for no
member archives and searches nothing, and forgets and counts as an
administrator; forgetting an agent's memory changes its work, which is its
owner's and the workspace's admins' (docs/security.md, "Who may do what";
`services/runtime/domain/access.py`).

One memory service on SQLite (fake embedder and directory, tokens signed
with the test key ring, as `memory_harness` starts it) serves the module.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from agentim.memory.v1 import memory_pb2 as pb
from services.common.identity import Caller, bearer_metadata
from services.common.tokens import KeyRing, PrincipalKind, Verifier, keyring_source
from services.memory.entrypoints.policy import MEMORY_POLICY, MEMORY_SERVICE
from tests.auth_support import auth_dir
from tests.authn_support import BAD_CREDENTIALS, Metadata, expected_status, expired_token, tampered_token
from tests.identities import Identity, as_member, as_service, member_token, remember
from tests.integration.memory_harness import RunningMemory, migrated_url, start_memory, stop_memory
from tests.memory_support import RunBuilder

OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED

CALLERS = (
    "owner",
    "admin",
    "member",
    "outsider",
    "stranger",
    "reader",
    "agent",
    "runtime",
    "memory",
    "no token",
    "expired",
    "tampered",
)

OTHER_WORKSPACE = {"stranger": DENIED}
# A service's own token acts for no member: it has no audience to search for.
AS_NO_MEMBER = {"runtime": DENIED}
RESOURCE: dict[str, dict[str, grpc.StatusCode]] = {
    "ArchiveRun": AS_NO_MEMBER,
    "Retrieve": OTHER_WORKSPACE | AS_NO_MEMBER,
    "Expand": OTHER_WORKSPACE | AS_NO_MEMBER,
    # Forgetting an agent's memory changes its work: not another member's to do.
    "Forget": OTHER_WORKSPACE | {"outsider": DENIED},
    # Counts, like the agent's card, are every member's to see.
    "GetMemoryStats": OTHER_WORKSPACE,
}


@dataclass
class Matrix:
    memory: RunningMemory
    workspace: str
    agent: str
    agent_member: str
    people: dict[str, str]
    metadata: dict[str, Metadata]
    callers: dict[str, Caller]
    # A segment of the run archived at the start, which every person of the workspace may read.
    ref: str

    def run(self) -> RunBuilder:
        """A new run of the agent in the group of everyone in the workspace."""
        everyone = [self.people[p] for p in ("owner", "admin", "member", "outsider")]
        return RunBuilder(self.workspace, self.agent, self.agent_member).user(
            "the alpha launch moves to friday", group="team", members=everyone
        )

    async def archived(self) -> pb.ArchivedRun:
        run = self.run().build()
        await self.memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run), metadata=self.metadata["agent"])
        return run


def person(memory: RunningMemory, workspace: str, role: str) -> str:
    member = memory.directory.add(workspace)
    remember(member, Identity(uuid.UUID(workspace), PrincipalKind.HUMAN, (role,)))
    return member


@pytest.fixture(scope="module")
async def matrix(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory: Path = tmp_path_factory.mktemp("memory-matrix")
    memory = await start_memory(await migrated_url("sqlite", directory))
    try:
        workspace, agent, agent_member = memory.new_workspace()
        other_workspace = str(uuid.uuid4())
        people = {
            "owner": person(memory, workspace, "owner"),
            "admin": person(memory, workspace, "admin"),
            "member": person(memory, workspace, "member"),
            "outsider": person(memory, workspace, "member"),
            "stranger": person(memory, other_workspace, "owner"),
        }
        # "member" owns the agent (the IM's directory says so).
        agent_info = memory.directory.members[agent_member]
        memory.directory.members[agent_member] = replace(agent_info, owner_id=people["member"])
        metadata: dict[str, Metadata] = {name: as_member(id_) for name, id_ in people.items()}
        metadata |= {
            "reader": as_member(people["owner"], read_only=True),
            "agent": as_member(agent_member),
            # Signed as the IM would issue them: no IM runs beside this memory service.
            "runtime": as_service("runtime"),
            "memory": as_service("memory"),
            "no token": (),
            "expired": bearer_metadata(
                expired_token(
                    Identity(uuid.UUID(workspace), PrincipalKind.HUMAN).claims(uuid.UUID(people["member"]))
                )
            ),
            "tampered": bearer_metadata(tampered_token(member_token(people["member"]))),
        }
        verifier = Verifier(keyring_source(KeyRing.load(auth_dir() / "keys")))
        callers = {
            name: Caller(claims=await verifier.verify(md[0][1].removeprefix("Bearer ")))
            for name, md in metadata.items()
            if name not in BAD_CREDENTIALS
        }
        m = Matrix(memory, workspace, agent, agent_member, people, metadata, callers, ref="")
        run = await m.archived()
        m.ref = f"{run.run_id}/1/0"
        yield m
    finally:
        await stop_memory(memory)


def expected(method: str, caller: str, m: Matrix) -> grpc.StatusCode:
    return expected_status(MEMORY_POLICY, f"/{MEMORY_SERVICE}/{method}", caller, m.callers, RESOURCE[method])


# -- one valid request per RPC, built fresh per call -----------------------------------


def _scope(m: Matrix) -> pb.AgentScope:
    return pb.AgentScope(agent_id=m.agent)


async def _archive(m: Matrix) -> Any:
    return pb.ArchiveRunRequest(run=m.run().build())


async def _retrieve(m: Matrix) -> Any:
    return pb.RetrieveRequest(agent=_scope(m), query="alpha launch")


async def _expand(m: Matrix) -> Any:
    return pb.ExpandRequest(agent=_scope(m), ref=m.ref)


async def _forget(m: Matrix) -> Any:
    return pb.ForgetRequest(run_id=(await m.archived()).run_id)


async def _stats(m: Matrix) -> Any:
    return pb.GetMemoryStatsRequest(agent_id=m.agent)


REQUESTS: dict[str, Callable[[Matrix], Any]] = {
    "ArchiveRun": _archive,
    "Retrieve": _retrieve,
    "Expand": _expand,
    "Forget": _forget,
    "GetMemoryStats": _stats,
}


def _cases() -> Iterator[Any]:
    for method in REQUESTS:
        for caller in CALLERS:
            yield pytest.param(method, caller, id=f"{method}-{caller}")


def test_every_rpc_of_the_memory_service_has_a_request_and_a_resource_rule_here() -> None:
    served = {method for method in MEMORY_POLICY if method.startswith(f"/{MEMORY_SERVICE}/")}
    in_proto = {
        f"/{MEMORY_SERVICE}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["MemoryService"].methods
    }
    assert served == in_proto
    assert {f"/{MEMORY_SERVICE}/{m}" for m in REQUESTS} == served
    assert {f"/{MEMORY_SERVICE}/{m}" for m in RESOURCE} == served


@pytest.mark.parametrize(("method", "caller"), list(_cases()))
async def test_every_caller_gets_what_the_rules_say(matrix: Matrix, method: str, caller: str) -> None:
    request = await REQUESTS[method](matrix)
    try:
        response = await getattr(matrix.memory.stub, method)(
            request, metadata=matrix.metadata[caller], timeout=10
        )
    except grpc.aio.AioRpcError as error:
        got = error.code()
    else:
        got = OK
        # An answer allowed is a real one, not an empty page.
        if method == "Retrieve":
            assert [hit.segment.text for hit in response.results] == ["the alpha launch moves to friday"]
        if method == "Expand":
            assert response.focus.text == "the alpha launch moves to friday"
    assert got.name == expected(method, caller, matrix).name


# -- what the status alone does not show ------------------------------------------------


async def test_another_member_finds_only_what_the_agent_said_in_a_shared_group(matrix: Matrix) -> None:
    # "Others see only what it says in the groups they share with it": its
    # thinking and tool calls are its work, its owner's and the admins' to read.
    run = matrix.run().assistant(
        "the beta answer", reasoning="the beta secret thinking", tool_calls=[("lookup", '{"q": "beta"}')]
    )
    await matrix.memory.stub.ArchiveRun(
        pb.ArchiveRunRequest(run=run.build()), metadata=matrix.metadata["agent"]
    )

    work = {pb.SEGMENT_TYPE_RESPONSE, pb.SEGMENT_TYPE_REASONING, pb.SEGMENT_TYPE_TOOL_CALL}

    async def found(caller: str) -> set[int]:
        request = pb.RetrieveRequest(
            agent=_scope(matrix), query="beta", limit=20, filters=pb.RetrieveFilters(types=sorted(work))
        )
        response = await matrix.memory.stub.Retrieve(request, metadata=matrix.metadata[caller])
        return {hit.segment.type for hit in response.results}

    assert await found("admin") == work
    assert await found("outsider") == {pb.SEGMENT_TYPE_RESPONSE}


async def test_a_member_who_owns_no_agent_forgets_no_whole_workspace(matrix: Matrix) -> None:
    # A workspace of its own: the matrix's memory stays whole whatever happens here.
    memory = matrix.memory
    workspace, agent, agent_member = memory.new_workspace()
    member = person(memory, workspace, "member")
    run = RunBuilder(workspace, agent, agent_member).user("keep this", group="g", members=[member]).build()
    await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run), metadata=as_member(agent_member))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await memory.stub.Forget(pb.ForgetRequest(workspace_id=workspace), metadata=as_member(member))
    assert refused.value.code() == DENIED

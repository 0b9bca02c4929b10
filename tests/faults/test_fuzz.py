"""Fault case 2: every public RPC of the IM, the runtime and the memory, fuzzed.

Requests are built from the services' descriptors (so a new RPC is fuzzed
without touching this file) by hypothesis: real ids of a real workspace
mixed with text holding NUL characters, long text, huge and negative
numbers, non-finite doubles, unknown enum numbers, deep JSON, and on the
wire invalid UTF-8 (a lone surrogate as its raw bytes, since no Python client
can serialize one), corrupt and truncated bytes. They are sent by a member of
the workspace, a member of another workspace, an unknown id and nobody.
Whatever comes, no answer is INTERNAL or UNKNOWN, and no status message
names an exception class.

The servers run in this process (the test's event loop); hypothesis drives
a synchronous gRPC client from a worker thread, so that it can shrink a
failing request against the live servers. `derandomize` makes CI's run
reproducible; FAULTS_LONG=1 tries many more requests.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2
from agentim.memory.v1 import memory_pb2 as mpb
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.identity import bearer_metadata
from services.common.request_rules import MAX_JSON_DEPTH
from tests.auth_support import service_secret
from tests.conftest import RunningIM, make_world
from tests.edge_support import start_runtime_on
from tests.faults.harness import UNLIMITED, scaled
from tests.identities import as_unknown, legacy_member_header
from tests.integration.test_memory_runtime import start_memory_service
from tests.integration.test_runtime_grpc import RunningRuntime


# (The IM has no rate limits: see conftest.py.)
@pytest.fixture
async def runtime_on(im: RunningIM, runtime_url: str) -> AsyncIterator[RunningRuntime]:
    running = await start_runtime_on(im.address, runtime_url, **UNLIMITED)
    yield running
    await running.channel.close()
    await running.app.stop()


SERVICES = [
    im_pb2.DESCRIPTOR.services_by_name["IMService"],
    auth_pb2.DESCRIPTOR.services_by_name["AuthService"],
    rpb.DESCRIPTOR.services_by_name["RuntimeService"],
    mpb.DESCRIPTOR.services_by_name["MemoryService"],
]
EXAMPLES_PER_RPC = scaled(12, long=300)
FUZZ_PASSWORD = "fuzzing password"
STREAM_SETTLE_POLLS = 15
FORBIDDEN_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
EXCEPTION_NAME = re.compile(r"Traceback|<class |\b[A-Za-z_]\w*(?:Error|Exception)\b")
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


# --- requests from descriptors ---------------------------------------------------------
#
# Each request is a plausible one (real ids, short text, small numbers, known
# enum values, small JSON) with at most one hostile change: a field set to a
# hostile value of its type, or its bytes damaged on the wire. One change at
# a time gets each hostile value past the other fields' checks, to the code
# (and the database) that would choke on it.


def deep_json(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


PLAIN_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=16)
SMALL_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | PLAIN_TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(PLAIN_TEXT, children, max_size=3),
    max_leaves=6,
)
HOSTILE_TEXT = st.one_of(
    st.sampled_from(["", " ", "\x00", "a\x00b", "-1", "9" * 40, "NaN", "null", "{}", "../..", "%00"]),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**19 - 1]).map(str),
    st.sampled_from([129, 201, 257, 2049, 70_000]).map(lambda n: "x" * n),
    st.sampled_from([1000, 30_000]).map(lambda n: "é" * n),
    st.text(max_size=30),
)
HOSTILE_JSON = st.one_of(
    st.integers(MAX_JSON_DEPTH - 1, 60).map(deep_json),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -(2**63), 2**64]).map(
        lambda number: {"n": number}
    ),
    st.sampled_from(["\x00", "k\x00"]).map(lambda key: {key: 1}),
    st.just({"big": "x" * 20_000}),
    st.dictionaries(st.text(max_size=8), st.floats() | st.text(max_size=8), max_size=4),
)


@dataclass
class Known:
    """Real values of a workspace, by the field names that take them."""

    by_name: dict[str, list[str]]

    def values(self, fd: FieldDescriptor) -> list[str] | None:
        name = fd.name
        if name == "id" and fd.containing_type is not None:
            name = f"{fd.containing_type.name.lower()}_id"
        for candidate in (
            name,
            name.removesuffix("s"),
            name.rsplit("_", 2)[-2] + "_id" if "_" in name else "",
        ):
            if candidate in self.by_name:
                return self.by_name[candidate]
        return None


def plain(fd: FieldDescriptor, known: Known) -> st.SearchStrategy[Any]:
    kind = fd.type
    if kind == FieldDescriptor.TYPE_STRING:
        values = known.values(fd)
        return st.sampled_from(values) if values else PLAIN_TEXT.filter(bool)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in _FLOATS:
        return st.floats(0, 2)
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values])  # type: ignore[union-attr]
    return st.integers(0, 50)


def hostile(fd: FieldDescriptor, known: Known) -> st.SearchStrategy[Any]:
    kind = fd.type
    if kind == FieldDescriptor.TYPE_STRING:
        return HOSTILE_TEXT | st.builds(lambda value, tail: value + tail, plain(fd, known), HOSTILE_TEXT)
    if kind in _FLOATS:
        return st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, 1e308, 2.0000001])
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([-1, 42, 2**31 - 1, -(2**31)])
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        edges = [v for v in (low, high, -1, 2**31 - 1, 2**31, 2**32, 2**53, -(2**31)) if low <= v <= high]
        return st.sampled_from(edges) | st.integers(low, high)
    return plain(fd, known)


def leaves(
    descriptor: Descriptor, prefix: tuple[FieldDescriptor, ...] = ()
) -> list[tuple[FieldDescriptor, ...]]:
    """Paths to every field a hostile value can go into (two message levels deep)."""
    found: list[tuple[FieldDescriptor, ...]] = []
    for fd in descriptor.fields:
        path = (*prefix, fd)
        found.append(path)
        nested = fd.message_type
        if nested is not None and not fd.is_repeated and not prefix and nested.full_name not in _OPAQUE:
            found += leaves(nested, path)
    return found


_FLOATS = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}
_OPAQUE = {"google.protobuf.Struct", "google.protobuf.FieldMask", "google.protobuf.Timestamp"}


def field_names() -> list[str]:
    names = {""}
    for service in SERVICES:
        for method in service.methods:
            for fd in method.input_type.fields:
                if fd.message_type is not None:
                    names.update(f.name for f in fd.message_type.fields)
    return sorted(names)


FIELD_NAMES = field_names()


@st.composite
def plausible(draw: st.DrawFn, descriptor: Descriptor, known: Known, depth: int = 0) -> Message:
    message = message_factory.GetMessageClass(descriptor)()
    if descriptor.full_name == "google.protobuf.Struct":
        message.update(draw(st.dictionaries(PLAIN_TEXT, SMALL_JSON, max_size=3)))  # type: ignore[attr-defined]
        return message
    if descriptor.full_name == "google.protobuf.FieldMask":
        message.paths.extend(draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=3)))  # type: ignore[attr-defined]
        return message
    for fd in descriptor.fields:
        if not draw(st.sampled_from([True, True, True, False])):
            continue
        if fd.message_type is not None:
            if depth < 2:
                sub = plausible(fd.message_type, known, depth + 1)
                for item in draw(st.lists(sub, min_size=1, max_size=2 if fd.is_repeated else 1)):
                    if fd.is_repeated:
                        getattr(message, fd.name).add().CopyFrom(item)
                    else:
                        getattr(message, fd.name).CopyFrom(item)
        elif fd.is_repeated:
            getattr(message, fd.name).extend(draw(st.lists(plain(fd, known), min_size=1, max_size=3)))
        else:
            setattr(message, fd.name, draw(plain(fd, known)))
    return message


@st.composite
def requests(draw: st.DrawFn, descriptor: Descriptor, known: Known) -> tuple[str, Message]:
    """A plausible request with at most one hostile field; returns (what changed, it)."""
    message = draw(plausible(descriptor, known))
    paths = leaves(descriptor)
    if not paths or not draw(st.sampled_from([False, True, True, True])):
        return "nothing", message
    path = draw(st.sampled_from(paths))
    target = message
    for step in path[:-1]:
        target = getattr(target, step.name)
    fd = path[-1]
    name = ".".join(f.name for f in path)
    if fd.message_type is not None:
        if fd.message_type.full_name != "google.protobuf.Struct" or fd.is_repeated:
            return "nothing", message
        getattr(target, fd.name).Clear()
        getattr(target, fd.name).update(draw(HOSTILE_JSON))
        return f"{name}=hostile JSON", message
    if fd.is_repeated:
        many = draw(st.sampled_from([1, 60, 600]))
        values = draw(st.lists(hostile(fd, known), min_size=1, max_size=1)) * many
        del getattr(target, fd.name)[:]
        getattr(target, fd.name).extend(values)
        return f"{name}=hostile x{many}", message
    setattr(target, fd.name, draw(hostile(fd, known)))
    return f"{name}=hostile", message


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def wire(draw: st.DrawFn, descriptor: Descriptor, payload: bytes) -> tuple[str, bytes]:
    """The request's bytes, often as they are, else damaged; returns (how, bytes)."""
    how = draw(
        st.sampled_from(
            ["as is"] * 6 + ["invalid UTF-8", "lone surrogate", "flipped", "truncated", "garbage"]
        )
    )
    text_fields = [fd.number for fd in descriptor.fields if fd.type == FieldDescriptor.TYPE_STRING]
    if how in ("invalid UTF-8", "lone surrogate") and text_fields:
        raw = b"\xff\xfe" if how == "invalid UTF-8" else b"ok \xed\xa0\x80"  # U+D800's would-be UTF-8
        number = draw(st.sampled_from(text_fields))
        return how, payload + varint(number << 3 | 2) + varint(len(raw)) + raw
    if how == "flipped" and payload:
        at = draw(st.integers(0, len(payload) - 1))
        return how, payload[:at] + bytes([payload[at] ^ draw(st.integers(1, 255))]) + payload[at + 1 :]
    if how == "truncated" and len(payload) > 1:
        return how, payload[: draw(st.integers(1, len(payload) - 1))]
    if how == "garbage":
        return how, draw(st.binary(min_size=1, max_size=40))
    return "as is", payload


# --- the fuzzing ------------------------------------------------------------------------


@dataclass
class Target:
    address: str
    service: str
    method: MethodDescriptor


@dataclass
class Figures:
    requests: int = 0
    hostile: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    wire: Counter[str] = field(default_factory=Counter)
    callers: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def call(channel: grpc.Channel, target: Target, payload: bytes, metadata: Any) -> tuple[grpc.StatusCode, str]:
    path = f"/{target.service}/{target.method.name}"
    if target.method.server_streaming:
        stream = channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        responses = stream(payload, metadata=metadata, timeout=10)
        responses.initial_metadata()
        # A stream may fail just after its headers (the first read of what it
        # resumes from): give it a moment before taking it as open.
        for _ in range(STREAM_SETTLE_POLLS):
            if responses.done():
                return responses.code(), responses.details() or ""
            time.sleep(0.01)
        responses.cancel()
        return grpc.StatusCode.OK, ""
    unary = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
    try:
        unary(payload, metadata=metadata, timeout=10)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def fuzz_rpc(target: Target, known: Known, callers: dict[str, Any], figures: Figures) -> None:
    """Runs hypothesis over one RPC; raises (with the shrunk request) on a forbidden answer."""
    channel = grpc.insecure_channel(target.address)
    descriptor = target.method.input_type

    @settings(
        max_examples=EXAMPLES_PER_RPC,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        request=requests(descriptor, known).flatmap(
            lambda changed: wire(descriptor, changed[1].SerializeToString()).map(
                lambda sent: (changed[0], *sent)
            )
        ),
        caller=st.sampled_from(["member"] * 4 + sorted(callers)),
    )
    def property_(request: tuple[str, str, bytes], caller: str) -> None:
        changed, how, payload = request
        code, details = call(channel, target, payload, callers[caller])
        with figures.lock:
            figures.requests += 1
            figures.statuses[code.name] += 1
            figures.wire[how] += 1
            figures.hostile += changed != "nothing"
            figures.callers[caller] += 1
        assert code not in FORBIDDEN_CODES, (
            f"{target.method.name} as {caller}, {changed}, wire {how}: {code.name} {details!r}"
        )
        assert not EXCEPTION_NAME.search(details), f"{target.method.name}: {details!r}"

    try:
        property_()
    finally:
        channel.close()


async def real_ids(im: RunningIM, runtime: RunningRuntime) -> tuple[Known, dict[str, Any]]:
    """A workspace with members, a group, a message, an agent with a step, a task and a
    checkpoint: ids the fuzz draws from, so that requests reach past id parsing."""
    world = await make_world(im.stub, people=2)
    other = await make_world(im.stub, people=1)
    md = world.md(0)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=md
        )
    ).group
    sent = (
        await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=group.id, content="hi"), metadata=md)
    ).message
    agent = (await runtime.stub.CreateAgent(rpb.CreateAgentRequest(name="fuzzed"), metadata=md)).agent
    await runtime.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=md)
    note = (
        await runtime.stub.AddNote(
            rpb.AddNoteRequest(agent_id=agent.id, role=rpb.STEP_ROLE_USER, content="note"), metadata=md
        )
    ).step
    task = (
        await runtime.stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=agent.id, input="t"), metadata=md)
    ).task
    checkpoint = (
        await runtime.stub.CreateCheckpoint(
            rpb.CreateCheckpointRequest(agent_id=agent.id, name="c"), metadata=md
        )
    ).checkpoint
    members = [*(m.id for m in world.members), agent.member_id]
    # Identity: a signed-in owner (an account), an invite, a personal token, a service token.
    auth = auth_pb2_grpc.AuthServiceStub(im.channel)
    login = f"fz{uuid.uuid4().hex[:8]}"
    signed_up = await im.stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(
            name="fuzzed", creator_display_name="Fuzz", creator_login=login, creator_password=FUZZ_PASSWORD
        )
    )
    tokens = signed_up.tokens
    invite = await auth.CreateInvite(
        auth_pb2.CreateInviteRequest(), metadata=bearer_metadata(tokens.access_token)
    )
    pat = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="fuzz", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_WRITE),
        metadata=bearer_metadata(tokens.access_token),
    )
    service = await auth.IssueServiceToken(
        auth_pb2.IssueServiceTokenRequest(service="runtime", secret=service_secret("runtime"))
    )
    known = Known(
        {
            "workspace_id": [world.workspace.id],
            "member_id": members,
            "peer_member_id": members,
            "mention": members,
            "group_id": [group.id],
            "message_id": [sent.id],
            "agent_id": [agent.id],
            "parent_id": [agent.id],
            "session_id": [note.session_id],
            "run_id": [note.run_id],
            "task_id": [task.id],
            "checkpoint_id": [checkpoint.id],
            "agent_member_id": [agent.member_id],
            "audience_member_ids": members,
            "ref": [f"{note.run_id}/{note.sequence}/0", ""],
            "tool": ["send_message", "read_history", "list_groups"],
            "page_token": [""],
            "after_cursor": ["", "0"],
            "base_url": ["", "http://127.0.0.1:9/v1"],
            "model": ["", "fake"],
            "path": ["name", "display_name", "avatar", "role", "system_prompt", "model", "tools"],
            "login": [login, "ghost"],
            "creator_login": [f"fz{uuid.uuid4().hex[:8]}"],
            "password": [FUZZ_PASSWORD],
            "creator_password": [FUZZ_PASSWORD],
            "old_password": [FUZZ_PASSWORD],
            "new_password": [FUZZ_PASSWORD + "!"],
            "refresh_token": [tokens.refresh_token],
            "invite": [invite.secret],
            "personal_token_id": [pat.personal_token.id],
            "secret": [pat.secret, service_secret("runtime")],
            "service": ["runtime", "memory"],
        }
    )
    callers: dict[str, Any] = {
        "member": md,
        "outsider": other.md(0),
        "unknown": as_unknown("018f0000-0000-7000-8000-000000000000"),
        # The retired header, with a malformed id: no credential at all.
        "retired header": legacy_member_header("not-a-member-" + "x" * 300),
        "nobody": (),
        "signed in": bearer_metadata(tokens.access_token),
        "service": bearer_metadata(service.access_token),
        "bad token": bearer_metadata(tokens.access_token[:-6] + "AAAAAA"),
    }
    return known, callers


# The long run (`make faults`) sends fifteen times as many requests.
@pytest.mark.timeout(scaled(120, long=900))
async def test_no_request_gets_internal_or_unknown(
    im: RunningIM, runtime_on: RunningRuntime, database_url: str, tmp_path: Path
) -> None:
    memory, memory_address = await start_memory_service(im, tmp_path)
    addresses = {
        "IMService": im.address,
        "AuthService": im.address,
        "RuntimeService": f"127.0.0.1:{runtime_on.app.server.port}",
        "MemoryService": memory_address,
    }
    targets = [
        Target(addresses[service.name], service.full_name, method)
        for service in SERVICES
        for method in service.methods
    ]
    # A world per RPC: what one RPC's requests delete or change (DeleteAgent,
    # RemoveGroupMembers...) must not turn the next RPC's into NOT_FOUND.
    worlds = [await real_ids(im, runtime_on) for _ in targets]
    figures = Figures()

    def fuzz_all() -> None:
        for target, (known, callers) in zip(targets, worlds, strict=True):
            fuzz_rpc(target, known, callers, figures)

    started = time.perf_counter()
    try:
        await asyncio.to_thread(fuzz_all)
    finally:
        await memory.stop()
    elapsed = time.perf_counter() - started
    statuses = ", ".join(f"{name} {count}" for name, count in figures.statuses.most_common())
    damaged = figures.requests - figures.wire["as is"]
    print(
        f"fuzz ({database_url.split(':', 1)[0]}): {len(targets)} RPCs, {figures.requests} requests"
        f" ({figures.hostile} with a hostile field, {damaged} damaged on the wire,"
        f" {figures.callers['nobody']} as nobody); {statuses};"
        f" 0 INTERNAL/UNKNOWN; {elapsed:.1f} s"
    )
    assert figures.requests >= len(targets) * EXAMPLES_PER_RPC // 2

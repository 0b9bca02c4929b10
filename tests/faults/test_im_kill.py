"""Fault case 4: `kill -9` of the IM under concurrent senders.

Senders loop, each message with its own request_id, retrying it (the same
request_id) until the IM acknowledges it; meanwhile the IM process is killed
with SIGKILL at random moments and started again on the same address. In the
end every acknowledged message is in the group exactly once: none lost,
none duplicated by a retry that crossed a crash.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from pathlib import Path

import grpc

from agentim.im.v1 import im_pb2, im_pb2_grpc
from tests.faults.harness import ServiceProcess, clean_environment, migrate, scaled
from tests.identities import as_member, learning_channel

# Channel options of a client that wants to be back soon after a restart.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class Senders:
    """Members sending numbered messages, each retried with its request_id until acknowledged."""

    def __init__(self, stub: im_pb2_grpc.IMServiceStub, group_id: str, member_id: str) -> None:
        self._stub = stub
        self._group_id = group_id
        self._md = as_member(member_id)
        self.acknowledged: dict[str, str] = {}  # request_id (also the content) -> message id
        self.unacknowledged = 0  # still being retried when the senders stopped
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, count: int) -> None:
        self._tasks = [asyncio.create_task(self._send(index)) for index in range(count)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _send(self, index: int) -> None:
        sequence = 0
        while not self._stop.is_set():
            request_id = f"s{index}-{sequence}"
            request = im_pb2.SendMessageRequest(
                group_id=self._group_id, content=request_id, request_id=request_id
            )
            while True:
                try:
                    sent = await self._stub.SendMessage(
                        request, metadata=self._md, timeout=5, wait_for_ready=True
                    )
                except grpc.aio.AioRpcError as error:
                    assert error.code() in RETRYABLE, f"{request_id}: {error.code()} {error.details()}"
                    if self._stop.is_set():
                        self.unacknowledged += 1
                        break
                    await asyncio.sleep(0.02)
                    continue
                self.acknowledged[request_id] = sent.message.id
                break
            sequence += 1


async def all_contents(stub: im_pb2_grpc.IMServiceStub, group_id: str, member_id: str) -> list[str]:
    """Every message of a group, oldest first."""
    contents: list[str] = []
    token = ""
    while True:
        page = await stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group_id, page_size=200, page_token=token),
            metadata=as_member(member_id),
            timeout=10,
        )
        contents += [m.content for m in page.messages]
        token = page.next_page_token
        if not token:
            return contents


async def test_every_acknowledged_message_survives_kills_exactly_once(
    database_url: str, tmp_path: Path
) -> None:
    kills = scaled(3, long=12)
    env = clean_environment(DATABASE_URL=database_url, IM_GRPC_ADDRESS="127.0.0.1:0")
    migrate("services.im", env)
    with ServiceProcess("services.im", env, tmp_path / "im.log") as im:
        im.start()
        im.pin_address("IM_GRPC_ADDRESS")
        channel = learning_channel(im.address, options=FAST_RECONNECT)
        stub = im_pb2_grpc.IMServiceStub(channel)
        created = await stub.CreateWorkspace(
            im_pb2.CreateWorkspaceRequest(name="kill", creator_display_name="ada"), timeout=10
        )
        me = created.creator.id
        group = (
            await stub.CreateGroup(im_pb2.CreateGroupRequest(name="g"), metadata=as_member(me), timeout=10)
        ).group
        senders = Senders(stub, group.id, me)
        senders.start(10)
        rng = random.Random(uuid.uuid4().int)
        try:
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(0.3, 1.0))
                im.kill()
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                im.start()
            await asyncio.sleep(0.5)
        finally:
            await senders.stop()
        stored = Counter(await all_contents(stub, group.id, me))
        await channel.close()

    lost = [rid for rid in senders.acknowledged if stored[rid] == 0]
    duplicated = [content for content, count in stored.items() if count > 1]
    assert len(senders.acknowledged) > kills * 10, f"too little traffic: {len(senders.acknowledged)}"
    assert im.starts == kills + 1
    assert lost == [], f"{len(lost)} acknowledged messages lost"
    assert duplicated == [], f"{len(duplicated)} messages stored twice"
    print(
        f"im kill: {kills} kills, {len(senders.acknowledged)} acknowledged,"
        f" {senders.unacknowledged} unacknowledged at the end, {len(lost)} lost, {len(duplicated)} duplicated"
    )

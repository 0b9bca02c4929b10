"""Per-member rate limits over real gRPC and HTTP: a member who sends too
fast is refused with RESOURCE_EXHAUSTED and when to come back (429 and
Retry-After at the gateway); other members are not held back."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import grpc
import pytest

from agentim.im.v1 import im_pb2
from services.common.ratelimit import retry_after_seconds
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from tests.conftest import make_world, start_im, stop_im
from tests.gateway_support import Api, start_gateway


async def test_a_member_sending_too_fast_waits_and_the_others_do_not(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    # Three messages at once, then one every 100 s; creating: twice, then one every 100 s.
    # (Creating the workspace names no member: it counts against the caller's address.)
    im = await start_im(
        url,
        LIMIT_SEND_PER_SECOND="0.01",
        LIMIT_SEND_BURST="3",
        LIMIT_CREATE_PER_SECOND="0.01",
        LIMIT_CREATE_BURST="2",
    )
    gateway = None
    try:
        world = await make_world(im.stub, people=2)  # Ada creates Bea: her first creation
        ada, bea = world.md(0), world.md(1)
        group = await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=ada
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="h"), metadata=ada)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        send = im_pb2.SendMessageRequest(group_id=group.group.id, content="hi")
        for _ in range(3):
            await im.stub.SendMessage(send, metadata=ada)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await im.stub.SendMessage(send, metadata=ada)
        error = refused.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "try again in" in (error.details() or "")
        wait = retry_after_seconds(error.trailing_metadata())
        assert wait is not None and 90 < wait <= 100
        await im.stub.SendMessage(send, metadata=bea)  # Bea has a bucket of her own
        listed = await im.stub.ListMessages(im_pb2.ListMessagesRequest(group_id=group.group.id), metadata=bea)
        assert len(listed.messages) == 4  # nothing refused was stored

        gateway = await start_gateway(im.address, "127.0.0.1:1")
        async with aiohttp.ClientSession() as http:
            api = Api(http, f"http://127.0.0.1:{gateway.port}")
            reply = await api.call(
                "POST",
                f"/v1/groups/{group.group.id}/messages",
                member=world.members[0].id,
                body={"content": "x"},
            )
        assert reply.status == 429 and reply.error["status"] == "RESOURCE_EXHAUSTED"
        assert 90 < int(reply.headers["Retry-After"]) <= 100
    finally:
        if gateway is not None:
            await gateway.stop()
        await stop_im(im)

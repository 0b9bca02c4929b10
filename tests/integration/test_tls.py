"""TLS and mutual TLS on the gRPC ports: the IM requires a client certificate
its CA signed; the runtime reaches it with its own; plaintext and unsigned
clients are refused; the health probe speaks TLS too."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from agentim.im.v1 import im_pb2, im_pb2_grpc
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.common.healthcheck import check
from services.common.settings import EnvReader
from services.common.tls import ClientTls, make_dev_certs, read_tls
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from tests.conftest import start_im, stop_im
from tests.identities import as_member, learn_member
from tests.integration.test_runtime_grpc import start_runtime, stop_runtime


def tls_env(certs: Path, name: str) -> dict[str, str]:
    return {
        "GRPC_TLS_CERT": str(certs / f"{name}.pem"),
        "GRPC_TLS_KEY": str(certs / f"{name}-key.pem"),
        "GRPC_TLS_CLIENT_CA": str(certs / "ca.pem"),
        "GRPC_TLS_CA": str(certs / "ca.pem"),
    }


def client(certs: Path, name: str | None) -> ClientTls:
    ca = (certs / "ca.pem").read_bytes()
    if name is None:
        return ClientTls(ca)
    return ClientTls(ca, (certs / f"{name}.pem").read_bytes(), (certs / f"{name}-key.pem").read_bytes())


async def create_workspace(address: str, tls: ClientTls | None) -> im_pb2.CreateWorkspaceResponse:
    channel = (
        grpc.aio.secure_channel(address, tls.credentials())
        if tls is not None
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        stub = im_pb2_grpc.IMServiceStub(channel)
        request = im_pb2.CreateWorkspaceRequest(name="tls", creator_display_name="Ada")
        response: im_pb2.CreateWorkspaceResponse = await stub.CreateWorkspace(request, timeout=5)
        learn_member(response.creator)
        return response


async def test_mutual_tls_lets_in_only_clients_the_ca_signed(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    make_dev_certs(certs, ["im", "runtime", "person"])
    assert (certs / "im-key.pem").stat().st_mode & 0o777 == 0o600
    url = f"sqlite:///{tmp_path / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    im = await start_im(url, **tls_env(certs, "im"))
    runtime = None
    try:
        created = await create_workspace(im.address, client(certs, "person"))
        assert created.creator.display_name == "Ada"
        for refused in (client(certs, None), None):  # no client certificate; plaintext
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await create_workspace(im.address, refused)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        # The health probe speaks TLS with the service's own certificate.
        assert await check(im.address, tls=client(certs, "runtime")) == "SERVING"

        # The runtime serves TLS and reaches the IM with its certificate.
        runtime = await start_runtime(im.address, tmp_path / "runtime.db", **tls_env(certs, "runtime"))
        address = f"127.0.0.1:{runtime.app.server.port}"
        async with grpc.aio.secure_channel(address, client(certs, "person").credentials()) as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            made = await stub.CreateAgent(
                rpb.CreateAgentRequest(name="scout"), metadata=as_member(created.creator.id), timeout=10
            )
        # Creating an agent registered its member in the IM, over mutual TLS.
        async with grpc.aio.secure_channel(im.address, client(certs, "person").credentials()) as channel:
            member = await im_pb2_grpc.IMServiceStub(channel).GetMember(
                im_pb2.GetMemberRequest(member_id=made.agent.member_id),
                metadata=as_member(created.creator.id),
                timeout=5,
            )
        assert member.member.kind == im_pb2.MEMBER_KIND_AGENT
    finally:
        if runtime is not None:
            await stop_runtime(runtime)
        await stop_im(im)


def test_tls_settings_name_every_problem(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    make_dev_certs(certs, ["im"])
    env = EnvReader(
        {
            "GRPC_TLS_CERT": str(certs / "im.pem"),
            "GRPC_TLS_CLIENT_CA": str(tmp_path / "missing.pem"),
            "GRPC_TLS_SERVER_NAME": "im",
        }
    )
    settings = read_tls(env)
    with pytest.raises(Exception) as failed:
        env.finish()
    message = str(failed.value)
    assert "GRPC_TLS_CERT and GRPC_TLS_KEY: set both or neither" in message
    assert "GRPC_TLS_CLIENT_CA: cannot read" in message
    assert "GRPC_TLS_SERVER_NAME: only used with GRPC_TLS_CA" in message
    assert settings.server is None and settings.describe() == "plaintext"
    whole = read_tls(EnvReader(tls_env(certs, "im")))
    assert whole.describe() == "mutual TLS" and whole.client is not None
    assert "BEGIN" not in repr(whole)  # keys never in a repr

"""The tokens a service calls with (services/common/service_auth.py): renewed
ahead of expiry, agents' tokens batched, refusals remembered."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.common.service_auth import (
    AgentTokens,
    Issued,
    ServiceToken,
    TokenRefused,
    read_service_secret,
    secret_from,
)
from services.common.settings import ConfigError, EnvReader
from services.runtime.config import Settings as RuntimeSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeAuth:
    """IssueServiceToken and IssueAgentTokens of an IM that hosts `ours`."""

    def __init__(self, clock: Clock, *, ours: set[uuid.UUID], lifetime: float = 900.0) -> None:
        self.clock = clock
        self.ours = ours
        self.lifetime = lifetime
        self.service_calls = 0
        self.agent_calls: list[list[uuid.UUID]] = []

    async def service_token(self, service: str, secret: str) -> Issued:
        if secret != "right":
            raise TokenRefused("UNAUTHENTICATED: the service name or secret is wrong")
        self.service_calls += 1
        return Issued(f"svc-{self.service_calls}", self.clock() + self.lifetime)

    async def agent_tokens(self, service_token: str, members: Sequence[uuid.UUID]) -> list[Issued]:
        assert service_token.startswith("svc-")
        self.agent_calls.append(list(members))
        if any(m not in self.ours for m in members):
            raise TokenRefused("PERMISSION_DENIED: not hosted")
        return [Issued(f"agent-{m}-{len(self.agent_calls)}", self.clock() + self.lifetime) for m in members]


def tokens(clock: Clock, auth: FakeAuth, secret: str | None = "right") -> tuple[ServiceToken, AgentTokens]:
    service = ServiceToken(service="runtime", secret=lambda: secret, issue=auth.service_token, clock=clock)
    return service, AgentTokens(issue=auth.agent_tokens, service=service, clock=clock)


async def test_the_service_token_is_kept_and_renewed_ahead_of_expiry() -> None:
    clock = Clock()
    auth = FakeAuth(clock, ours=set())
    service, _ = tokens(clock, auth)
    assert await service.get() == "svc-1"
    clock.now += 600  # 300 s of 900 left: still more than a quarter
    assert await service.get() == "svc-1"
    clock.now += 100  # 200 s left: less than a quarter
    assert await service.get() == "svc-2"


async def test_no_credential_means_no_token_and_a_wrong_one_is_refused() -> None:
    clock = Clock()
    auth = FakeAuth(clock, ours=set())
    assert await tokens(clock, auth, secret=None)[0].get() is None
    with pytest.raises(TokenRefused):
        await tokens(clock, auth, secret="wrong")[0].get()


async def test_agents_asked_for_at_once_get_their_tokens_in_one_call() -> None:
    clock = Clock()
    agents = [uuid.uuid4() for _ in range(5)]
    auth = FakeAuth(clock, ours=set(agents))
    _, agent_tokens = tokens(clock, auth)
    got = await asyncio.gather(*(agent_tokens.get(a) for a in agents))
    assert got == [f"agent-{a}-1" for a in agents]
    assert auth.agent_calls == [agents]
    # Kept: no call for the next requests.
    assert await agent_tokens.get(agents[0]) == f"agent-{agents[0]}-1"
    assert len(auth.agent_calls) == 1


async def test_an_agent_token_is_renewed_ahead_of_expiry_and_the_old_one_used_meanwhile() -> None:
    clock = Clock()
    ada = uuid.uuid4()
    auth = FakeAuth(clock, ours={ada})
    _, agent_tokens = tokens(clock, auth)
    assert await agent_tokens.get(ada) == f"agent-{ada}-1"
    clock.now += 700  # due for renewal, not expired
    assert await agent_tokens.get(ada) == f"agent-{ada}-1"  # still good; renewal under way
    await asyncio.sleep(0.01)
    assert await agent_tokens.get(ada) == f"agent-{ada}-2"
    clock.now += 2000  # the held one expired long ago: wait for the new one
    assert await agent_tokens.get(ada) == f"agent-{ada}-3"


async def test_a_member_not_hosted_gets_no_token_and_is_not_asked_about_again_soon() -> None:
    clock = Clock()
    ada, person = uuid.uuid4(), uuid.uuid4()
    auth = FakeAuth(clock, ours={ada})
    _, agent_tokens = tokens(clock, auth)
    got = await asyncio.gather(agent_tokens.get(ada), agent_tokens.get(person))
    assert list(got) == [f"agent-{ada}-2", None]
    # The batch was refused as a whole; each was then asked for alone.
    assert auth.agent_calls == [[ada, person], [ada], [person]]
    assert await agent_tokens.get(person) is None
    assert len(auth.agent_calls) == 3


def test_the_secret_comes_from_the_setting_or_a_file_read_when_it_appears(tmp_path: Path) -> None:
    assert secret_from(value="aim_svc_x", path=None)() == "aim_svc_x"
    file = tmp_path / "runtime.secret"
    source = secret_from(value=None, path=file)
    assert source() is None
    file.write_text("aim_svc_y\n")
    assert source() == "aim_svc_y"


def test_outside_the_embedded_default_a_credential_is_required(tmp_path: Path) -> None:
    env = EnvReader({})
    read_service_secret(env, prefix="RUNTIME", service="runtime", data_dir=tmp_path, embedded=False)
    with pytest.raises(ConfigError, match="RUNTIME_SERVICE_SECRET"):
        env.finish()
    env = EnvReader({"RUNTIME_SERVICE_SECRET_FILE": str(tmp_path / "missing")})
    read_service_secret(env, prefix="RUNTIME", service="runtime", data_dir=tmp_path, embedded=False)
    with pytest.raises(ConfigError, match="no readable file"):
        env.finish()
    embedded = read_service_secret(
        EnvReader({}), prefix="RUNTIME", service="runtime", data_dir=tmp_path, embedded=True
    )
    assert embedded.path == tmp_path / "secrets" / "runtime.secret"
    given = read_service_secret(
        EnvReader({"RUNTIME_SERVICE_SECRET": "aim_svc_z"}),
        prefix="RUNTIME",
        service="runtime",
        data_dir=tmp_path,
        embedded=False,
    )
    assert "aim_svc_z" not in repr(given)


def test_the_runtime_refuses_to_start_on_postgresql_without_its_credential() -> None:
    postgres = {"RUNTIME_DATABASE_URL": "postgresql://x@h/db"}
    with pytest.raises(ConfigError, match="RUNTIME_SERVICE_SECRET"):
        RuntimeSettings.from_env(postgres)
    settings = RuntimeSettings.from_env({**postgres, "RUNTIME_SERVICE_SECRET": "aim_svc_secret"})
    assert "aim_svc_secret" not in repr(settings)
    source = settings.service_secret.source()
    assert source is not None and source() == "aim_svc_secret"
    with pytest.raises(ConfigError, match="RUNTIME_LLM_ALLOWED_HOSTS"):
        RuntimeSettings.from_env({"RUNTIME_LLM_ALLOWED_HOSTS": "ok.example.com,http://bad/"})

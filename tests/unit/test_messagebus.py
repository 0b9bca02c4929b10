"""The IM's message bus and composition root: every command reaches its handler,
secrets stay out of a command's repr, and the app closes what it opened."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

from services.im.domain import commands
from services.im.domain.errors import NotAllowed
from services.im.service_layer.messagebus import MessageBus
from tests.unit.fakes import InMemoryStore
from tests.unit.support import World, build_on_fakes, me, unit_settings


async def test_every_command_has_a_handler_in_the_built_app() -> None:
    declared = {
        value
        for value in vars(commands).values()
        if inspect.isclass(value) and issubclass(value, commands.Command) and value is not commands.Command
    }
    app = build_on_fakes(unit_settings())
    assert declared == app.bus.commands


async def test_a_command_is_handled_by_its_handler_and_an_unknown_one_is_refused() -> None:
    @dataclass(frozen=True)
    class Shout(commands.Command[str]):
        text: str

    @dataclass(frozen=True)
    class Whisper(commands.Command[str]):
        text: str

    async def shout(command: Shout) -> str:
        return command.text.upper()

    bus = MessageBus({Shout: shout})
    assert bus.commands == {Shout}
    assert await bus.handle(Shout(text="hi")) == "HI"
    with pytest.raises(LookupError, match="Whisper"):
        await bus.handle(Whisper(text="hi"))


def test_a_password_is_not_in_the_repr_of_a_command() -> None:
    command = commands.CreateWorkspace(
        name="acme", creator_display_name="Ada", creator_login="ada", creator_password="hunter2-hunter2"
    )
    assert "hunter2" not in repr(command)


@pytest.mark.parametrize(
    "command",
    [
        commands.SignIn(login="ada", password="hunter2-hunter2"),
        commands.RefreshTokens(refresh_token="aim_rt_hunter2"),
        commands.SignOut(refresh_token="aim_rt_hunter2"),
        commands.ChangePassword(caller=None, old_password="hunter2-old", new_password="hunter2-new"),
        commands.AcceptInvite(
            invite="aim_inv_hunter2", display_name="Bea", login="bea", password="hunter2-hunter2"
        ),
        commands.ExchangePersonalToken(secret="aim_pat_hunter2"),
        commands.IssueServiceToken(service="runtime", secret="hunter2"),
        commands.SignInWithOidc(id_token="hunter2.jwt", nonce="hunter2-nonce", invite="aim_inv_hunter2"),
        commands.LinkOidcAccount(caller=None, id_token="hunter2.jwt", nonce="hunter2-nonce"),
    ],
    ids=lambda command: type(command).__name__,
)
def test_no_secret_of_an_identity_command_is_in_its_repr(command: commands.Command[object]) -> None:
    assert "hunter2" not in repr(command)


async def test_the_app_is_an_async_context_manager_that_closes_its_store() -> None:
    store = InMemoryStore()
    async with build_on_fakes(unit_settings(), store=store) as app:
        await app.bus.handle(commands.CreateWorkspace(name="acme", creator_display_name="Ada"))
        assert store.state.workspaces
        assert not store.closed
    assert store.closed
    await app.stop()  # idempotent


async def test_a_service_command_refused_through_the_bus_changes_nothing() -> None:
    async with World.make() as world:
        _, ada = await world.workspace()
        before = world.store.commits
        with pytest.raises(NotAllowed):
            await world.bus.handle(
                commands.SetAgentOwners(caller=me(ada), owners=[(str(ada.id), str(ada.id))])
            )
        assert world.store.commits == before

"""The runners of every replica, reached from any of them.

Any replica answers any call; the agent's runner lives in the replica that
holds its shard (see `leases`). `ReplicaRunners` calls this replica's
`Supervisor` for the agents it runs and sends the rest to their owner over a
`ReplicaLink`: a control waits for the owner's answer (`ask`), a wake or a
change of settings is told and not awaited (`tell`). What such a call
decides is already in the database (a task, new settings, an edited
history), so a message that is lost only delays its effect: the owner reads
the database again (`Supervisor.reconcile`) whenever its link may have
missed messages, when it gains a shard, and every `reconcile_seconds` all
the same (a message told to a replica that had just given the agent's shard
away is lost without any outage).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from services.common import errors
from services.runtime.domain.errors import AgentGone, InvalidTransition
from services.runtime.domain.lifecycle import Control
from services.runtime.domain.model import Agent
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.supervisor import Supervisor

logger = logging.getLogger(__name__)

# How often a message for an agent whose shard is between owners looks for
# its new owner (waits of 50 ms doubling to 2 s: about half a minute, longer
# than a lease lives).
_OWNERLESS_TRIES = 20
# How long a message told to an owner is kept to be told again to the next
# owner, should the shard move meanwhile (the last one may have given the
# agent away as the message came, and dropped it).
_RETELL_SECONDS = 10.0

Message = Mapping[str, Any]
# Serves a message sent to this replica; returns the answer of an `ask`.
Inbox = Callable[[Message], Awaitable[Message | None]]


class ReplicaLink(abc.ABC):
    """Messages between runtime replicas, each named by its replica id."""

    @abc.abstractmethod
    def serve(self, inbox: Inbox, *, missed: Callable[[], None]) -> None:
        """Hands every message sent to this replica to `inbox`; `missed` is
        called whenever messages may have been lost (the link was down)."""

    @abc.abstractmethod
    async def tell(self, replica: str, message: Message) -> None:
        """Sends without waiting for an answer; kept and sent again once the
        link is back if it cannot be sent now."""

    @abc.abstractmethod
    async def ask(self, replica: str, message: Message) -> Message:
        """Sends and waits for the answer (the caller bounds the wait).

        Raises:
            Unavailable: the link cannot send it now.
        """

    @property
    def degraded(self) -> bool:
        """Whether messages to this replica may be lost now (it reads the
        database again meanwhile: see `serve`'s `missed`)."""
        return False

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Starts listening."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Stops listening. Idempotent."""


class AgentMoving(errors.Unavailable):
    """The agent's shard is between replicas: the call is worth repeating."""


# The refusals an owner sends back, by name, raised again where the call came in.
_REFUSALS: dict[str, type[errors.ServiceError]] = {
    "InvalidTransition": InvalidTransition,
    "AgentGone": AgentGone,
    "AgentMoving": AgentMoving,
}


class ReplicaRunners(Runners):
    """`Runners` across replicas (see the module's docstring).

    Args:
        local: this replica's runners (those of the shards it holds).
        link: the link to the other replicas.
        owner_of: the replica that holds a workspace's shard, as last seen
            (None: nobody holds it now).
        replica: this replica's id.
        store: where an agent's workspace (and state) is read.
        ask_timeout_seconds: how long a forwarded control waits for the owner.
        reconcile_seconds: how often the database is read for what messages
            may have missed (`start` begins).
        leases_changed: called when another replica says the shard leases
            changed (`announce_leases`): its keeper runs a round now.
    """

    def __init__(
        self,
        local: Supervisor,
        link: ReplicaLink,
        *,
        owner_of: Callable[[uuid.UUID], str | None],
        replica: str,
        store: AgentStore,
        ask_timeout_seconds: float = 10.0,
        reconcile_seconds: float = 5.0,
        leases_changed: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._local = local
        self._leases_changed = leases_changed
        self._clock = clock
        # Per agent, the last message told to another replica: the message,
        # the agent's workspace (if known), when, and to whom.
        self._told: dict[uuid.UUID, tuple[Message, uuid.UUID | None, float, str]] = {}
        self._link = link
        self._owner_of = owner_of
        self._replica = replica
        self._store = store
        self._timeout = ask_timeout_seconds
        self._workspaces: dict[uuid.UUID, uuid.UUID] = {}
        self._telling: set[asyncio.Task[None]] = set()
        self._reconcile_every = reconcile_seconds
        self._reconciler: asyncio.Task[None] | None = None
        link.serve(self._serve, missed=self._missed)

    def start(self) -> None:
        """Starts reading the database for missed work every `reconcile_seconds`."""
        if self._reconciler is None:
            self._reconciler = asyncio.create_task(self._reconcile(), name="replica-reconcile")

    async def _reconcile(self) -> None:
        while True:
            await asyncio.sleep(self._reconcile_every)
            try:
                await self._local.reconcile()
            except errors.ServiceError as error:
                logger.warning("reading the database for missed work failed: %s", error)

    # -- the port ------------------------------------------------------------------

    def replica_of(self, agent: Agent) -> str:
        return self._owner_of(agent.workspace_id) or ""

    def live(self, agent_id: uuid.UUID) -> Agent | None:
        return self._local.live(agent_id)

    def start_agent(self, agent: Agent) -> None:
        self._workspaces[agent.id] = agent.workspace_id
        if self._owner_of(agent.workspace_id) == self._replica:
            self._local.start_agent(agent)
        else:
            self._tell_owner(agent.id, {"op": "start", "agent": str(agent.id)}, agent.workspace_id)

    async def stop_agent(self, agent_id: uuid.UUID) -> None:
        if self._local.live(agent_id) is not None:
            await self._local.stop_agent(agent_id)
            return
        owner = await self._owner(agent_id)
        if owner is not None and owner != self._replica:
            await self._ask(owner, {"op": "stop", "agent": str(agent_id)})

    def update(self, agent: Agent) -> Agent | None:
        live = self._local.update(agent)
        if live is None:
            self._tell_owner(agent.id, {"op": "update", "agent": str(agent.id)}, agent.workspace_id)
        return live

    def wake(self, agent_id: uuid.UUID, *, retry: bool = False) -> None:
        if self._local.live(agent_id) is not None:
            self._local.wake(agent_id, retry=retry)
            return
        self._tell_owner(agent_id, {"op": "wake", "agent": str(agent_id), "retry": retry})

    def forget_history(self, agent_id: uuid.UUID) -> None:
        if self._local.live(agent_id) is not None:
            self._local.forget_history(agent_id)
            return
        self._tell_owner(agent_id, {"op": "forget", "agent": str(agent_id)})

    async def go_on(self, agent_id: uuid.UUID) -> None:
        if self._local.live(agent_id) is not None:
            await self._local.go_on(agent_id)
            return
        owner = await self._owner(agent_id)
        if owner is not None:
            await self._ask(owner, {"op": "go_on", "agent": str(agent_id)})

    async def apply(self, agent_id: uuid.UUID, control: Control) -> Agent:
        if self._local.live(agent_id) is not None:
            return await self._local.apply(agent_id, control)
        owner = await self._owner(agent_id)
        if owner is None:
            raise AgentMoving(f"no replica runs agent {agent_id} now (its shard is moving); try again")
        await self._ask(owner, {"op": "apply", "agent": str(agent_id), "control": control.value})
        # The owner stored the state the control left before it answered.
        stored = await self._store.get_agent(agent_id)
        if stored is None:
            raise AgentGone(f"agent {agent_id} was deleted")
        return stored

    async def cancel_task(self, agent_id: uuid.UUID, task_id: uuid.UUID) -> bool:
        if self._local.live(agent_id) is not None:
            return await self._local.cancel_task(agent_id, task_id)
        owner = await self._owner(agent_id)
        if owner is None:
            return False
        answer = await self._ask(owner, {"op": "cancel_task", "agent": str(agent_id), "task": str(task_id)})
        return bool(answer.get("cut"))

    async def aclose(self) -> None:
        tasks = [*self._telling, *([self._reconciler] if self._reconciler is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reconciler = None

    # -- reaching the owner --------------------------------------------------------------

    async def _owner(self, agent_id: uuid.UUID) -> str | None:
        workspace = self._workspaces.get(agent_id)
        if workspace is None:
            agent = await self._store.get_agent(agent_id)
            if agent is None:
                return None
            workspace = self._workspaces[agent_id] = agent.workspace_id
        return self._owner_of(workspace)

    def _tell_owner(self, agent_id: uuid.UUID, message: Message, workspace: uuid.UUID | None = None) -> None:
        """Tells the agent's owner, in the background; while its shard is
        between owners, as soon as it has one (or serves it here, if this
        replica takes it)."""

        async def tell() -> None:
            wait = 0.05
            for _ in range(_OWNERLESS_TRIES):
                owner = self._owner_of(workspace) if workspace is not None else await self._owner(agent_id)
                if owner == self._replica:
                    await self._serve(message)
                    return
                if owner is not None:
                    known = workspace if workspace is not None else self._workspaces.get(agent_id)
                    self._told[agent_id] = (message, known, self._clock(), owner)
                    await self._link.tell(owner, message)
                    return
                await asyncio.sleep(wait)
                wait = min(wait * 2, 2.0)
            logger.warning("no replica took agent %s's shard: %s not sent", agent_id, message.get("op"))

        self._spawn(tell())

    def owners_changed(self) -> None:
        """The shards' owners as this replica sees them changed: what was
        told lately to an owner that no longer runs the agent is told again
        to the one that does (a wake told to a replica that was handing the
        shard over is dropped there)."""
        now = self._clock()
        for agent_id, (message, workspace, at, told) in list(self._told.items()):
            if now - at > _RETELL_SECONDS:
                del self._told[agent_id]
                continue
            owner = self._owner_of(workspace) if workspace is not None else None
            if owner is not None and owner != told:
                del self._told[agent_id]
                self._tell_owner(agent_id, message, workspace)

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            except errors.ServiceError as error:
                # The database says what was decided; the owner reads it again.
                logger.warning("a message to another replica was not sent: %s", error)
            except Exception:
                logger.exception("a message between replicas failed")

        task = asyncio.create_task(run(), name="tell-replica")
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _ask(self, owner: str, message: Message) -> Message:
        try:
            async with asyncio.timeout(self._timeout):
                answer = await self._link.ask(owner, message)
        except TimeoutError:
            raise AgentMoving(
                f"replica {owner} did not answer within {self._timeout:g} s; try again"
            ) from None
        refused = answer.get("refused")
        if refused:
            kind = _REFUSALS.get(str(refused), errors.Unavailable)
            raise kind(str(answer.get("message") or refused))
        return answer

    # -- serving the other replicas -------------------------------------------------------

    async def announce_leases(self, replicas: Collection[str]) -> None:
        """Tells `replicas` that shards were released or a replica joined."""
        await asyncio.gather(*[self._link.tell(replica, {"op": "leases"}) for replica in replicas])

    async def _serve(self, message: Message) -> Message | None:
        if message.get("op") == "leases":
            self._leases_changed()
            return None
        op, agent_id = message.get("op"), uuid.UUID(str(message.get("agent")))
        if op in ("start", "update"):
            agent = await self._store.get_agent(agent_id)
            if agent is not None:
                if op == "start":
                    self._local.start_agent(agent)
                else:
                    self._local.update(agent)
            return None
        if op == "wake":
            self._local.look_again(agent_id, retry=bool(message.get("retry")))
            return None
        if op == "forget":
            self._local.forget_history(agent_id)
            return None
        return await self._answer(op, agent_id, message)

    async def _answer(self, op: object, agent_id: uuid.UUID, message: Message) -> Message:
        if op == "stop":
            await self._local.stop_agent(agent_id)
            return {}
        if self._local.live(agent_id) is None:
            return {
                "refused": "AgentMoving",
                "message": f"agent {agent_id} is moving between replicas; try again",
            }
        try:
            if op == "apply":
                await self._local.apply(agent_id, Control(str(message.get("control"))))
                return {}
            if op == "go_on":
                await self._local.go_on(agent_id)
                return {}
            if op == "cancel_task":
                return {"cut": await self._local.cancel_task(agent_id, uuid.UUID(str(message.get("task"))))}
        except (InvalidTransition, AgentGone) as refused:
            return {"refused": type(refused).__name__, "message": str(refused)}
        return {"refused": "Unavailable", "message": f"unknown request {op!r}"}

    def _missed(self) -> None:
        self._spawn(self._local.reconcile())

"""The runner's inbox: messages the IM's events bring, catching up with the IM, read marks."""

from __future__ import annotations

import asyncio
import logging
import uuid

from services.runtime.domain.etiquette import ends_exchange, should_answer
from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import Origin, Run, StepMetrics
from services.runtime.service_layer.im_port import IMMessage
from services.runtime.service_layer.runner.core import _NO_MESSAGE, RunnerCore, _Taken

logger = logging.getLogger(__name__)


class Inbox(RunnerCore):
    """What the agent is asked: the messages its events bring (one push per
    wake), the IM's unread ones when it must catch up, which of them call
    for an answer, and how far each chat is read."""

    def deliver(self, message: IMMessage) -> None:
        """A message of one of the agent's chats, as the IM's event brought it:
        the runner takes it from here, without asking the IM again."""
        if message.sender_id == self.agent.member_id:
            return
        if self._marks is not None and message.id <= self._marks.get(message.group_id, _NO_MESSAGE):
            return  # input already (an event that came again)
        if message.id not in self._inbox and len(self._inbox) >= self._env.settings.unread_batch:
            # More waits than a run takes in: the IM keeps them all, ask it.
            self._inbox.clear()
            self._catch_up = True
        else:
            self._inbox[message.id] = message
        self.wake()

    @property
    def owes_input(self) -> bool:
        """Whether messages wait to be read in (or the IM to be asked for
        them): after a failure, a runner idles until its retry with them."""
        return bool(self._inbox) or self._catch_up

    def catch_up(self) -> None:
        """Makes the runner ask the IM for its unread messages: the events
        may not have brought them all (at the start, after a gap)."""
        self._catch_up = True
        self.wake()

    def on_message(self, message: IMMessage, *, from_person: bool) -> None:
        """A message in one of the agent's groups: the answer a tool may be waiting for."""
        if not from_person:
            return
        for (group_id, after), waiter in list(self._reply_waiters.items()):
            if group_id == message.group_id and message.id > after and not waiter.done():
                waiter.set_result(message)

    async def _wait_for_reply(self, group_id: uuid.UUID, after: uuid.UUID) -> IMMessage:
        waiter: asyncio.Future[IMMessage] = asyncio.get_running_loop().create_future()
        self._reply_waiters[(group_id, after)] = waiter
        try:
            # Asked again after a restart, the answer may be there already.
            earlier = await self._reply_in_history(group_id, after)
            if earlier is not None and not waiter.done():
                waiter.set_result(earlier)
            return await waiter
        finally:
            self._reply_waiters.pop((group_id, after), None)

    async def _reply_in_history(self, group_id: uuid.UUID, after: uuid.UUID) -> IMMessage | None:
        member = self.agent.member_id
        recent = await self._env.im.list_messages(member, group_id, limit=50)
        for message in recent:
            if (
                message.id > after
                and message.sender_id != member
                and await self._env.directory.is_person(member, message.sender_id)
            ):
                return message
        return None

    async def _take_unread(self, chat: uuid.UUID | None = None) -> _Taken:
        """The unread messages of one chat that call for an answer and were
        not taken as input before, and how far each group is then read; the
        IM is told (`_mark_read`) once they are stored as steps.

        A run answers one chat (`chat`, or the one with the oldest message
        waiting): the messages of other chats wait for runs of their own,
        each with its own conversation's context."""
        member = self.agent.member_id
        if self._marks is None:
            self._marks = await self._env.store.read_marks(self.agent.id)
        if self._catch_up:
            await self._catch_up_with_the_im()
        marks = self._marks
        for message_id in [i for i, m in self._inbox.items() if i <= marks.get(m.group_id, _NO_MESSAGE)]:
            del self._inbox[message_id]
        unread = sorted(self._inbox.values(), key=lambda m: m.id)
        if not unread:
            return _Taken()
        latest: dict[uuid.UUID, uuid.UUID] = {}
        relevant: list[IMMessage] = []
        for message in unread:
            latest[message.group_id] = message.id
            if message.id <= self._marks.get(message.group_id, _NO_MESSAGE):
                continue  # input already; only the IM's read mark was late (or lost)
            if message.sender_id == member or not self._env.guard.allows(message.group_id):
                continue
            if await self._calls_for_answer(message):
                relevant.append(message)
        if relevant:
            chosen = chat if chat is not None else relevant[0].group_id
            waiting = {m.group_id for m in relevant if m.group_id != chosen}
            relevant = [m for m in relevant if m.group_id == chosen]
            for group_id in waiting:
                del latest[group_id]  # read in its own run
            if waiting:
                self.wake()
        self._pending_reads.update(latest)
        return _Taken(relevant, latest)

    async def _catch_up_with_the_im(self) -> None:
        """Adds the IM's unread messages to those the events brought."""
        self._catch_up = False
        if self._env.read_positions is not None:
            # The IM's page starts after its read positions: move them first.
            await self._env.read_positions.flush(self.agent.member_id)
        # Bounded: after a restart every agent looks at once, and the IM must not drown.
        try:
            async with self._env.reads:
                unread = await self._env.im.get_all_unread(
                    self.agent.member_id, limit=self._env.settings.unread_batch
                )
        except BaseException:
            self._catch_up = True  # still to do
            raise
        if len(unread) >= self._env.settings.unread_batch:
            self.catch_up()  # a full page: there may be more after it
        for message in unread:
            self._inbox.setdefault(message.id, message)

    async def _calls_for_answer(self, message: IMMessage) -> bool:
        if message.content_type == "system":
            return False  # a notice (another agent's failure): nothing to answer
        member, directory = self.agent.member_id, self._env.directory
        is_direct, _ = await directory.group(member, message.group_id)
        mentions = set(message.mentions)
        if ends_exchange(message.metadata) and not await directory.is_person(member, message.sender_id):
            return member in mentions  # an answer to an answer: the exchange is over
        if is_direct or member in mentions:
            return True
        replies_to_agent = (
            message.reply_to is not None and await directory.sender(member, message.reply_to) == member
        )
        return should_answer(
            agent_member_id=member,
            is_direct=is_direct,
            mentions=mentions,
            policy=self._env.settings.group_policy,
            from_person=await directory.is_person(member, message.sender_id),
            replies_to_agent=replies_to_agent,
        )

    def _advance_marks(self, marks: dict[uuid.UUID, uuid.UUID]) -> None:
        if self._marks is None:
            return  # not loaded yet: the load will bring these
        for group_id, message_id in marks.items():
            if message_id > self._marks.get(group_id, _NO_MESSAGE):
                self._marks[group_id] = message_id
        for message_id in [
            i for i, m in self._inbox.items() if i <= self._marks.get(m.group_id, _NO_MESSAGE)
        ]:
            del self._inbox[message_id]

    async def _mark_read(self) -> None:
        pending, self._pending_reads = self._pending_reads, {}
        if self._env.read_positions is not None:
            self._env.read_positions.move(self.agent.member_id, pending.items())
            return
        outcomes = await asyncio.gather(
            *[self._env.im.mark_read(self.agent.member_id, group, up_to) for group, up_to in pending.items()],
            return_exceptions=True,
        )
        for (group, up_to), outcome in zip(pending.items(), outcomes, strict=True):
            if isinstance(outcome, Exception):
                # Kept for the next try; meanwhile those messages stay unread
                # in the IM (the agent's own marks keep them from being input twice).
                logger.warning("agent %s: marking group %s read failed: %s", self.agent.id, group, outcome)
                self._pending_reads.setdefault(group, up_to)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _incoming(self, message: IMMessage) -> tuple[ChatMessage, Origin]:
        """An IM message as an input step: its text, and who sent it where."""
        member = self.agent.member_id
        direct, name = await self._env.directory.group(member, message.group_id)
        sender = await self._env.directory.name(member, message.sender_id)
        origin = Origin(
            group_id=message.group_id,
            group_name=name,
            direct=direct,
            sender_id=message.sender_id,
            sender_name=sender,
            message_id=message.id,
        )
        return ChatMessage(role=Role.USER, content=message.content), origin

    async def _read_in(self, run: Run, taken: _Taken) -> None:
        """Adds messages to the context as user steps (in one write with how
        far they were read), then marks them read in the IM."""
        inputs = [await self._incoming(message) for message in taken.messages]
        steps = [self._step(run, message, StepMetrics(), origin=origin) for message, origin in inputs]
        await self._env.store.append_input(self.agent.id, steps, taken.marks, fence=self._fence())
        self._advance_marks(taken.marks)
        for step in steps:
            self._remember(step)
        await self._mark_read()

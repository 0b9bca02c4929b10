"""The task RPCs that change something: SubmitTask and CancelTask.

A submitted task is QUEUED in the agent's queue (`StoredTaskQueue`) and its
runner is woken; a cancel ends a waiting task at once, and asks the runner to
cut a running one short (see `services.runtime.service_layer.tasks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any

from uuid_utils.compat import uuid7

from services.common import audit, errors
from services.common.identity import Caller
from services.runtime.domain.commands import CancelTask, SubmitTask
from services.runtime.domain.errors import InvalidTaskRequest, TaskAlreadyEnded, TaskRequestReused
from services.runtime.domain.model import Placed, Task, TaskStatus
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.agent_audit import AgentAudit
from services.runtime.service_layer.agent_factory import MAX_REQUEST_ID_CHARS
from services.runtime.service_layer.messagebus import Handler
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tasks import WAITING, StoredTaskQueue, TaskViews


@dataclass(frozen=True)
class Tasks:
    """What the task handlers use.

    Args:
        max_input_bytes: the largest task input (UTF-8).
        cancel_wait_seconds: how long CancelTask waits for the runner to cut
            a running task short before answering with the task as it is.
    """

    store: AgentStore
    queue: StoredTaskQueue
    views: TaskViews
    runners: Runners
    access: AgentAccess
    audit: AgentAudit
    clock: Callable[[], datetime]
    max_input_bytes: int = 64 * 1024
    cancel_wait_seconds: float = 10.0


async def submit_task(command: SubmitTask, deps: Tasks) -> Placed:
    """Queues a task (or returns the one submitted with the same request_id) and wakes the agent."""
    principal, text, request_id = command.caller, command.text, command.request_id
    session_id, priority = command.session_id, command.priority
    agent = await deps.access.controlled(principal, command.agent_id)
    if not text.strip():
        raise InvalidTaskRequest("input is required")
    size = len(text.encode())
    if size > deps.max_input_bytes:
        raise InvalidTaskRequest(f"input is {size} bytes; the limit is {deps.max_input_bytes}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidTaskRequest(f"request_id is limited to {MAX_REQUEST_ID_CHARS} characters")
    session = await deps.views.session_of(agent, session_id)
    asked = (text, priority, session if session_id else None)
    # A request_id used before is found by the write itself (which then stores nothing).
    task = Task(
        id=uuid7(),
        agent_id=agent.id,
        session_id=session,
        input=text,
        status=TaskStatus.QUEUED,
        created_at=deps.clock(),
        priority=priority,
        request_id=request_id,
    )
    record = deps.audit.record(
        principal,
        agent,
        "SubmitTask",
        target=audit.Target("task", str(task.id)),
        request_id=request_id,
        details={"agent_id": str(agent.id), "priority": str(priority)},
    )
    try:
        stored = await deps.store.add_task(task, audit=record)
    except errors.Unavailable:
        # The write may have committed all the same (only its answer was
        # lost): the caller's retry then finds the task, which the runner
        # must not miss.
        deps.queue.may_have_changed(agent.id)
        deps.runners.wake(agent.id)
        raise
    if stored.id != task.id:  # a call with the request_id got there first
        return await deps.views.placed(_replayed(stored, asked))
    deps.queue.added(stored)
    deps.queue.publish(stored, workspace_id=agent.workspace_id)
    deps.runners.wake(agent.id)
    return await deps.views.placed(stored)


async def cancel_task(command: CancelTask, deps: Tasks) -> Placed:
    """Cancels a waiting task at once; asks the runner to cut a running one short.

    Raises:
        TaskAlreadyEnded: it succeeded, died or was cancelled already.
    """
    principal = command.caller
    task = await deps.views.visible(principal, command.task_id)
    while True:
        if task.status in WAITING:
            ended = replace(task, status=TaskStatus.CANCELLED, ended_at=deps.clock(), retry_at=None)
            if await deps.store.update_task(ended, expected=WAITING):
                deps.queue.left(ended)
                # The agent is in the caller's workspace (or `visible` refused).
                deps.queue.publish(ended, workspace_id=deps.access.viewer(principal).workspace_id)
                await _cancelled_by(principal, task, deps)
                return Placed(ended)
        elif task.status is TaskStatus.RUNNING:
            placed = Placed(await _cancel_running(task, deps))
            await _cancelled_by(principal, task, deps)
            return placed
        else:
            raise TaskAlreadyEnded(
                f"task {task.id} is {task.status.value}:"
                " only queued, failed or running tasks can be cancelled"
            )
        # Its status changed meanwhile (the runner started it): look again.
        task = await deps.queue.reread(task)


async def _cancelled_by(principal: Caller | None, task: Task, deps: Tasks) -> None:
    agent = await deps.store.get_agent(task.agent_id)
    if agent is not None:
        await deps.audit.write(
            principal,
            agent,
            "CancelTask",
            target=audit.Target("task", str(task.id)),
            details={"agent_id": str(agent.id), "was": task.status.value},
        )


async def _cancel_running(task: Task, deps: Tasks) -> Task:
    stopped = deps.queue.cancelling(task)
    # The runner cuts the task's run short, then reports it `cancelled`.
    if not await deps.runners.cancel_task(task.agent_id, task.id):
        # Nobody here runs it (a run lost with its process): end it now.
        await deps.queue.cancel_unrun(task)
    else:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), deps.cancel_wait_seconds)
    return await deps.queue.reread(task)


def _replayed(found: Task, asked: tuple[str, int, uuid.UUID | None]) -> Task:
    """The task a request_id was used for, if it was asked for the same thing."""
    text, priority, session = asked
    differs = [
        name
        for name, same in (
            ("input", found.input == text),
            ("priority", found.priority == priority),
            ("session_id", session is None or found.session_id == session),
        )
        if not same
    ]
    if differs:
        raise TaskRequestReused(
            f"request_id {found.request_id!r} was already used for task {found.id} of this agent"
            f" with another {' and '.join(differs)}"
        )
    return found


def handlers(deps: Tasks) -> dict[type[Any], Handler]:
    """The task commands' handlers, bound to `deps`."""
    return {
        SubmitTask: partial(submit_task, deps=deps),
        CancelTask: partial(cancel_task, deps=deps),
    }

"""RuntimeService RPCs of tasks: a mixin of `RuntimeServicer`."""

from __future__ import annotations

from typing import Any, TypeAlias

from agentim.runtime.v1 import runtime_pb2 as pb
from services.common.identity import Caller
from services.runtime.domain.commands import CancelTask, SubmitTask
from services.runtime.domain.model import Placed
from services.runtime.entrypoints import mappers
from services.runtime.service_layer.messagebus import MessageBus
from services.runtime.service_layer.tasks import TaskViews

Context: TypeAlias = Any


def _task(placed: Placed) -> pb.Task:
    return mappers.task(placed.task, position=placed.position)


class TaskRpcs:
    """SubmitTask, GetTask, ListTasks, CancelTask, GetQueueStats."""

    _tasks: TaskViews
    _bus: MessageBus

    async def _caller(self, context: Context) -> Caller | None:
        raise NotImplementedError  # RuntimeServicer's

    async def SubmitTask(self, request: pb.SubmitTaskRequest, context: Context) -> pb.SubmitTaskResponse:
        placed = await self._bus.handle(
            SubmitTask(
                caller=await self._caller(context),
                agent_id=request.agent_id,
                text=request.input,
                request_id=request.request_id,
                session_id=request.session_id,
                priority=request.priority,
            )
        )
        return pb.SubmitTaskResponse(task=_task(placed))

    async def GetTask(self, request: pb.GetTaskRequest, context: Context) -> pb.GetTaskResponse:
        placed = await self._tasks.get_task(await self._caller(context), request.task_id)
        return pb.GetTaskResponse(task=_task(placed))

    async def ListTasks(self, request: pb.ListTasksRequest, context: Context) -> pb.ListTasksResponse:
        page, token = await self._tasks.list_tasks(
            await self._caller(context),
            request.agent_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListTasksResponse(tasks=[_task(p) for p in page], next_page_token=token)

    async def CancelTask(self, request: pb.CancelTaskRequest, context: Context) -> pb.CancelTaskResponse:
        placed = await self._bus.handle(
            CancelTask(caller=await self._caller(context), task_id=request.task_id)
        )
        return pb.CancelTaskResponse(task=_task(placed))

    async def GetQueueStats(
        self, request: pb.GetQueueStatsRequest, context: Context
    ) -> pb.GetQueueStatsResponse:
        stats = await self._tasks.queue_stats(await self._caller(context), request.agent_id)
        return pb.GetQueueStatsResponse(
            queued=stats.queued, running=stats.running, average_wait_ms=stats.average_wait_ms
        )

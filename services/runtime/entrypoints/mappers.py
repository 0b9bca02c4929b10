"""Runtime domain objects to protobuf messages and back; nothing else."""

from __future__ import annotations

import uuid
from datetime import datetime

from google.protobuf import timestamp_pb2

from agentim.runtime.v1 import runtime_pb2 as pb
from services.runtime.domain import llm
from services.runtime.domain.model import (
    Agent,
    AgentState,
    Checkpoint,
    Emitted,
    MainSessionChanged,
    Origin,
    Run,
    RunEnded,
    RunStarted,
    RunStatus,
    Session,
    StateChanged,
    Step,
    StepAborted,
    StepCompleted,
    StepDelta,
    StepKind,
    StepsRewritten,
    StepStarted,
    Task,
    TaskChanged,
    TaskStatus,
)
from services.runtime.service_layer.replica_status import ListedReplica

AGENT_STATES = {
    AgentState.IDLE: pb.AGENT_STATE_IDLE,
    AgentState.RUNNING: pb.AGENT_STATE_RUNNING,
    AgentState.ERROR: pb.AGENT_STATE_ERROR,
    AgentState.PAUSED: pb.AGENT_STATE_PAUSED,
    AgentState.TERMINATED: pb.AGENT_STATE_TERMINATED,
}
ROLES = {
    llm.Role.SYSTEM: pb.STEP_ROLE_SYSTEM,
    llm.Role.USER: pb.STEP_ROLE_USER,
    llm.Role.ASSISTANT: pb.STEP_ROLE_ASSISTANT,
    llm.Role.TOOL: pb.STEP_ROLE_TOOL,
}
RUN_STATUSES = {
    RunStatus.RUNNING: pb.RUN_STATUS_RUNNING,
    RunStatus.COMPLETED: pb.RUN_STATUS_COMPLETED,
    RunStatus.FAILED: pb.RUN_STATUS_FAILED,
    RunStatus.ITERATION_LIMIT: pb.RUN_STATUS_ITERATION_LIMIT,
    RunStatus.BUDGET_EXHAUSTED: pb.RUN_STATUS_BUDGET_EXHAUSTED,
    RunStatus.INTERRUPTED: pb.RUN_STATUS_INTERRUPTED,
}


def timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(value)
    return out


def model_settings_in(value: pb.ModelSettings) -> llm.ModelSettings:
    return llm.ModelSettings(
        model=value.model,
        base_url=value.base_url,
        temperature=value.temperature if value.HasField("temperature") else None,
        max_tokens=value.max_tokens if value.HasField("max_tokens") else None,
        context_tokens=value.context_tokens if value.HasField("context_tokens") else None,
    )


def model_settings(value: llm.ModelSettings) -> pb.ModelSettings:
    out = pb.ModelSettings(model=value.model, base_url=value.base_url)
    if value.temperature is not None:
        out.temperature = value.temperature
    if value.max_tokens is not None:
        out.max_tokens = value.max_tokens
    if value.context_tokens is not None:
        out.context_tokens = value.context_tokens
    return out


def agent(a: Agent, *, replica: str = "") -> pb.Agent:
    return pb.Agent(
        id=str(a.id),
        workspace_id=str(a.workspace_id),
        member_id=str(a.member_id),
        name=a.name,
        role=a.role,
        system_prompt=a.system_prompt,
        model=model_settings(a.model),
        tools=list(a.tools),
        parent_id=str(a.parent_id) if a.parent_id else "",
        state=AGENT_STATES[a.state],
        last_error=a.last_error,
        tokens_used=a.tokens_used,
        token_budget=a.token_budget,
        create_time=timestamp(a.created_at),
        update_time=timestamp(a.updated_at),
        main_session_id=str(a.session_id),
        pause_pending=a.pause_pending,
        auto_recall=a.auto_recall,
        state_version=a.state_version,
        owner_id=str(a.owner_id) if a.owner_id else "",
        replica=replica,
    )


STEP_KINDS = {
    StepKind.MESSAGE: pb.STEP_KIND_MESSAGE,
    StepKind.SUMMARY: pb.STEP_KIND_SUMMARY,
    StepKind.RECALL: pb.STEP_KIND_RECALL,
    StepKind.CUT: pb.STEP_KIND_CUT,
}


def step(s: Step) -> pb.Step:
    message, metrics = s.message, s.metrics
    return pb.Step(
        id=str(s.id),
        agent_id=str(s.agent_id),
        session_id=str(s.session_id),
        run_id=str(s.run_id),
        sequence=s.sequence,
        role=ROLES[message.role],
        content=message.content or "",
        reasoning=message.reasoning or "",
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls],
        tool_call_id=message.tool_call_id or "",
        name=message.name or "",
        metrics=pb.StepMetrics(
            duration_ms=metrics.duration_ms,
            first_token_ms=metrics.first_token_ms,
            input_tokens=metrics.input_tokens,
            output_tokens=metrics.output_tokens,
            cached_tokens=metrics.cached_tokens,
            model=metrics.model,
            tool_duration_ms=metrics.tool_duration_ms,
            usage_estimated=metrics.usage_estimated,
        ),
        create_time=timestamp(s.created_at),
        interrupted=s.interrupted,
        kind=STEP_KINDS[s.kind],
        summary_through=s.summary_through,
        origin=step_origin(s.origin) if s.origin is not None else None,
    )


def step_origin(o: Origin) -> pb.StepOrigin:
    def some_id(value: uuid.UUID | None) -> str:
        return str(value) if value is not None else ""

    return pb.StepOrigin(
        group_id=some_id(o.group_id),
        group_name=o.group_name,
        direct=o.direct,
        sender_id=some_id(o.sender_id),
        sender_name=o.sender_name,
        message_id=some_id(o.message_id),
        task_id=some_id(o.task_id),
    )


def run(r: Run) -> pb.Run:
    out = pb.Run(
        id=str(r.id),
        agent_id=str(r.agent_id),
        session_id=str(r.session_id),
        status=RUN_STATUSES[r.status],
        trigger_message_ids=[str(m) for m in r.trigger_message_ids],
        iterations=r.iterations,
        error=r.error,
        start_time=timestamp(r.started_at),
    )
    if r.ended_at is not None:
        out.end_time.CopyFrom(timestamp(r.ended_at))
    return out


def event(e: Emitted) -> pb.AgentEvent:
    out = pb.AgentEvent(agent_id=str(e.agent_id), event_time=timestamp(e.at))
    match e.event:
        case RunStarted(run=r):
            out.run_started.CopyFrom(run(r))
        case RunEnded(run=r):
            out.run_ended.CopyFrom(run(r))
        case StepStarted(run_id=run_id, sequence=sequence, role=role):
            out.step_started.CopyFrom(pb.StepStarted(run_id=str(run_id), sequence=sequence, role=ROLES[role]))
        case StepDelta(sequence=sequence, delta=delta):
            out.step_delta.sequence = sequence
            match delta:
                case llm.ContentDelta(text=text):
                    out.step_delta.content = text
                case llm.ReasoningDelta(text=text):
                    out.step_delta.reasoning = text
                case llm.ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments):
                    out.step_delta.tool_call.CopyFrom(
                        pb.ToolCallFragment(
                            index=index, id=call_id or "", name=name or "", arguments=arguments
                        )
                    )
        case StepCompleted(step=s):
            out.step_completed.CopyFrom(step(s))
        case StepAborted(run_id=run_id, sequence=sequence, reason=reason):
            out.step_aborted.CopyFrom(pb.StepAborted(run_id=str(run_id), sequence=sequence, reason=reason))
        case StateChanged(state=state, error=error, pause_pending=pending, version=version):
            out.state_changed.CopyFrom(
                pb.AgentStateChanged(
                    state=AGENT_STATES[state], error=error, pause_pending=pending, state_version=version
                )
            )
        case MainSessionChanged(session=s):
            out.main_session_changed.CopyFrom(session(s, main=True))
        case StepsRewritten(session_id=session_id, after_sequence=after_sequence):
            out.steps_rewritten.CopyFrom(
                pb.StepsRewritten(session_id=str(session_id), after_sequence=after_sequence)
            )
        case TaskChanged(task=t):
            out.task_changed.CopyFrom(task(t))
    return out


def session(s: Session, *, main: bool, step_count: int = 0) -> pb.Session:
    return pb.Session(
        id=str(s.id),
        agent_id=str(s.agent_id),
        main=main,
        forked_from_session_id=str(s.forked_from) if s.forked_from else "",
        forked_at_sequence=s.forked_at_sequence,
        step_count=step_count,
        create_time=timestamp(s.created_at),
    )


def checkpoint(c: Checkpoint) -> pb.Checkpoint:
    return pb.Checkpoint(
        id=str(c.id),
        agent_id=str(c.agent_id),
        name=c.name,
        session_id=str(c.session_id),
        sequence=c.sequence,
        settings=agent(c.settings),
        create_time=timestamp(c.created_at),
    )


TASK_STATUSES = {
    TaskStatus.QUEUED: pb.TASK_STATUS_QUEUED,
    TaskStatus.RUNNING: pb.TASK_STATUS_RUNNING,
    TaskStatus.SUCCEEDED: pb.TASK_STATUS_SUCCEEDED,
    TaskStatus.FAILED: pb.TASK_STATUS_FAILED,
    TaskStatus.CANCELLED: pb.TASK_STATUS_CANCELLED,
    TaskStatus.DEAD: pb.TASK_STATUS_DEAD,
}


def task(t: Task, *, position: int = 0) -> pb.Task:
    """A task; `position` (tasks ahead of it) matters while it is QUEUED."""
    out = pb.Task(
        id=str(t.id),
        agent_id=str(t.agent_id),
        session_id=str(t.session_id),
        input=t.input,
        status=TASK_STATUSES[t.status],
        priority=t.priority,
        position=position,
        attempts=t.attempts,
        last_error=t.last_error,
        result=t.result,
        request_id=t.request_id,
        create_time=timestamp(t.created_at),
        run_id=str(t.run_id) if t.run_id else "",
    )
    for field, value in (
        (out.start_time, t.started_at),
        (out.end_time, t.ended_at),
        (out.retry_time, t.retry_at),
    ):
        if value is not None:
            field.CopyFrom(timestamp(value))
    return out


def replica(r: ListedReplica) -> pb.RuntimeReplica:
    status = r.status
    out = pb.RuntimeReplica(
        id=status.replica,
        address=r.address,
        shards=status.shards,
        agents=status.agents,
        runs_in_flight=status.runs_in_flight,
        leases_proven=status.leases_proven,
        link_degraded=status.link_degraded,
        renewals=status.renewals,
        renewal_failures=status.renewal_failures,
        shards_taken=status.shards_taken,
        shards_released=status.shards_released,
        shards_lost=status.shards_lost,
        refused_fenced_writes=status.refused_fenced_writes,
        answering=r.answering,
    )
    if r.started_at is not None:
        out.start_time.CopyFrom(timestamp(r.started_at))
    if r.reported_at is not None:
        out.report_time.CopyFrom(timestamp(r.reported_at))
    return out

"""Who may call each RPC of the runtime (see docs/security.md, "Who may do what").

No tool of an agent calls the runtime over gRPC, so only people do. Which
agent a person may see or control is decided by the handlers. Rules marked
`audited` are privileged actions (see services.common.audit).
"""

from __future__ import annotations

from agentim.runtime.v1 import runtime_pb2
from services.common.authn import HUMAN, Policy, reads, writes

RUNTIME_SERVICE = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name

RUNTIME_POLICY = Policy.of_service(
    RUNTIME_SERVICE,
    {
        "CreateAgent": writes(HUMAN).audited("agent"),
        "GetAgent": reads(HUMAN),
        "ListAgents": reads(HUMAN),
        "UpdateAgent": writes(HUMAN).audited("agent", "agent.id"),
        "DeleteAgent": writes(HUMAN).audited("agent", "agent_id"),
        "WakeAgent": writes(HUMAN),
        "ListRuns": reads(HUMAN),
        "ListSteps": reads(HUMAN),
        "WatchAgent": reads(HUMAN),
        "WatchAgents": reads(HUMAN),
        "StartAgent": writes(HUMAN).audited("agent", "agent_id"),
        "PauseAgent": writes(HUMAN).audited("agent", "agent_id"),
        "ResumeAgent": writes(HUMAN).audited("agent", "agent_id"),
        "InterruptAgent": writes(HUMAN).audited("agent", "agent_id"),
        "TerminateAgent": writes(HUMAN).audited("agent", "agent_id"),
        "UpdateStep": writes(HUMAN).audited("agent", "agent_id"),
        "DeleteStep": writes(HUMAN).audited("agent", "agent_id"),
        "AddNote": writes(HUMAN).audited("agent", "agent_id"),
        "CreateCheckpoint": writes(HUMAN).audited("agent", "agent_id"),
        "ListCheckpoints": reads(HUMAN),
        "RestoreCheckpoint": writes(HUMAN).audited("agent", "agent_id"),
        "ListSessions": reads(HUMAN),
        "SetMainSession": writes(HUMAN).audited("agent", "agent_id"),
        "RetryFromStep": writes(HUMAN).audited("agent", "agent_id"),
        "ForkFromStep": writes(HUMAN).audited("agent", "agent_id"),
        "SubmitTask": writes(HUMAN).audited("agent", "agent_id"),
        "GetTask": reads(HUMAN),
        "ListTasks": reads(HUMAN),
        "CancelTask": writes(HUMAN).audited("task", "task_id"),
        "GetQueueStats": reads(HUMAN),
        "ListTools": reads(HUMAN),
        "ListAuditEvents": reads(HUMAN),
        "ListReplicas": reads(HUMAN),
    },
)

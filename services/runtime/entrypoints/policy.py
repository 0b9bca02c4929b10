"""Who may call each RPC of the runtime (see docs/security.md, "Who may do what").

No tool of an agent calls the runtime over gRPC, so only people do. Which
agent a person may see or control is decided by the handlers.
"""

from __future__ import annotations

from agentim.runtime.v1 import runtime_pb2
from services.common.authn import HUMAN, Policy, reads, writes

RUNTIME_SERVICE = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name

RUNTIME_POLICY = Policy.of_service(
    RUNTIME_SERVICE,
    {
        "CreateAgent": writes(HUMAN),
        "GetAgent": reads(HUMAN),
        "ListAgents": reads(HUMAN),
        "UpdateAgent": writes(HUMAN),
        "DeleteAgent": writes(HUMAN),
        "WakeAgent": writes(HUMAN),
        "ListRuns": reads(HUMAN),
        "ListSteps": reads(HUMAN),
        "WatchAgent": reads(HUMAN),
        "WatchAgents": reads(HUMAN),
        "StartAgent": writes(HUMAN),
        "PauseAgent": writes(HUMAN),
        "ResumeAgent": writes(HUMAN),
        "InterruptAgent": writes(HUMAN),
        "TerminateAgent": writes(HUMAN),
        "UpdateStep": writes(HUMAN),
        "DeleteStep": writes(HUMAN),
        "AddNote": writes(HUMAN),
        "CreateCheckpoint": writes(HUMAN),
        "ListCheckpoints": reads(HUMAN),
        "RestoreCheckpoint": writes(HUMAN),
        "ListSessions": reads(HUMAN),
        "SetMainSession": writes(HUMAN),
        "RetryFromStep": writes(HUMAN),
        "ForkFromStep": writes(HUMAN),
        "SubmitTask": writes(HUMAN),
        "GetTask": reads(HUMAN),
        "ListTasks": reads(HUMAN),
        "CancelTask": writes(HUMAN),
        "GetQueueStats": reads(HUMAN),
        "ListTools": reads(HUMAN),
    },
)

"""Who may call each RPC of the memory service (see docs/security.md, "Who may do what").

Whose memories a caller may search or forget is decided by the handlers.
Agent tokens exist only for the agents the runtime hosts, and only the
runtime holds them: an agent here is the runtime acting as that agent (an
archived run is its own agent's, and recall searches as the agent).
"""

from __future__ import annotations

from agentim.memory.v1 import memory_pb2
from services.common.authn import AGENT, HUMAN, Policy, Service, reads, writes

MEMORY_SERVICE = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name
RUNTIME = Service("runtime")

MEMORY_POLICY = Policy.of_service(
    MEMORY_SERVICE,
    {
        "ArchiveRun": writes(AGENT, RUNTIME),
        "Retrieve": reads(HUMAN, AGENT, RUNTIME),
        "Expand": reads(HUMAN, AGENT, RUNTIME),
        "Forget": writes(HUMAN, RUNTIME),
        "GetMemoryStats": reads(HUMAN, RUNTIME),
    },
)

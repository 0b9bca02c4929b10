"""Who may call each RPC of the memory service (see docs/security.md, "Who may do what").

Whose memories a caller may search or forget is decided by the handlers.
"""

from __future__ import annotations

from agentim.memory.v1 import memory_pb2
from services.common.authn import HUMAN, Policy, Service, reads, writes

MEMORY_SERVICE = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name
RUNTIME = Service("runtime")

MEMORY_POLICY = Policy.of_service(
    MEMORY_SERVICE,
    {
        "ArchiveRun": writes(RUNTIME),
        "Retrieve": reads(HUMAN, RUNTIME),
        "Expand": reads(HUMAN, RUNTIME),
        "Forget": writes(HUMAN, RUNTIME),
        "GetMemoryStats": reads(HUMAN, RUNTIME),
    },
)

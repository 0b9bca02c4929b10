"""The IM's audit log, as its workspaces' owners and admins read it."""

from __future__ import annotations

from services.common import audit
from services.common.identity import Caller
from services.im.domain.errors import NotAllowed
from services.im.service_layer.handlers.auth_deps import AuthDeps, calling_member


async def list_audit_events(
    auth: AuthDeps, caller: Caller | None, query: audit.AuditQuery, *, page_size: int, page_token: str
) -> tuple[list[audit.AuditRecord], str]:
    """The IM's audit records of the caller's workspace, newest first (its owner and admins only)."""
    async with auth.uow(write=False) as tx:
        member = await calling_member(tx, caller)
    if caller is not None and caller.view_as is not None:
        raise NotAllowed("a view as an agent does not read the audit log")
    if member.role.value not in audit.ADMIN_ROLES:
        raise NotAllowed("only the workspace's owner and admins read its audit log")
    if auth.audit_log is None:
        return [], ""
    return await audit.list_page(
        auth.audit_log, member.workspace_id, query, page_token=page_token, size=page_size
    )

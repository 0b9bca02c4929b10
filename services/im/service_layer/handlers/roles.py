"""Roles: the owner and admins change what the members of their workspace may do."""

from __future__ import annotations

import logging
from dataclasses import replace

from services.common import audit
from services.im.domain import access, rules
from services.im.domain.commands import SetMemberRole
from services.im.domain.errors import InvalidRequest, NotFound
from services.im.domain.model import Member
from services.im.service_layer.handlers.auth_deps import AuthDeps, authority, caller_record, calling_member

logger = logging.getLogger(__name__)


async def set_member_role(auth: AuthDeps, command: SetMemberRole) -> Member:
    """Gives the member the role (as `access.role_changes` allows); records each member it changes."""
    caller, role = command.caller, command.role
    if role is None:
        raise InvalidRequest("role is required (OWNER, ADMIN or MEMBER)")
    target_id = rules.parse_id(command.member_id, "member_id")
    allowed = authority(caller)
    async with auth.uow() as tx:
        member = await calling_member(tx, caller)
        access.require_write(allowed, "change roles")
        target = await tx.get_member(target_id)
        if target is None or target.workspace_id != member.workspace_id:
            raise NotFound(f"member {target_id} not found")
        changes = access.role_changes(member, target, role)
        for changed, new_role in changes:
            await tx.set_role(changed, new_role)
            await tx.add_audit(
                caller_record(
                    auth,
                    caller,
                    member,
                    "SetMemberRole",
                    audit.Target("member", str(changed)),
                    details={"role": new_role.value},
                )
            )
        await tx.commit()
    if changes:
        logger.info("member %s set the role of %s to %s", member.id, target.id, role.value)
    return replace(target, role=dict(changes).get(target.id, target.role))

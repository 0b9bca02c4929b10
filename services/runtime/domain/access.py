"""Who may do what to an agent: the runtime's access rules, as a pure table.

Members of a workspace see its agents (their card and state). Only an
agent's owner and the workspace's admins and owner control it (lifecycle),
reconfigure it, and read or change its work (steps, runs, sessions,
history, checkpoints, memory, tasks). Only admins and the owner set an
agent's model endpoint (`model.base_url`). An agent of another workspace
does not exist for the caller.

Roles come from the caller's access token, so a role change reaches the
runtime when the caller's next token is issued (within the token lifetime,
15 minutes).
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass

# Workspace roles that control every agent of the workspace.
PRIVILEGED_ROLES = frozenset({"owner", "admin"})


class Action(enum.Enum):
    """What a caller does to an agent; the value words the refusal."""

    VIEW = "see"
    CONTROL = "control, reconfigure or read the work of"
    SET_ENDPOINT = "set the model endpoint (model.base_url) of"


class Verdict(enum.Enum):
    ALLOWED = "allowed"
    # Refused, saying why: PERMISSION_DENIED.
    DENIED = "denied"
    # Refused as if it did not exist (another workspace's agent): NOT_FOUND.
    HIDDEN = "hidden"


@dataclass(frozen=True, slots=True)
class Viewer:
    """The calling member as the runtime's rules see it.

    Attributes:
        member_id: the member.
        workspace_id: its workspace.
        roles: its workspace roles, from its token.
    """

    member_id: uuid.UUID
    workspace_id: uuid.UUID
    roles: frozenset[str]

    @property
    def privileged(self) -> bool:
        """An admin or the owner of the workspace."""
        return bool(self.roles & PRIVILEGED_ROLES)


def decide(viewer: Viewer, action: Action, *, workspace_id: uuid.UUID, owner_id: uuid.UUID | None) -> Verdict:
    """May `viewer` do `action` to an agent of `workspace_id` owned by `owner_id`?

    `owner_id` None is an agent created before owners were recorded: only
    admins and the workspace's owner control it.
    """
    if workspace_id != viewer.workspace_id:
        return Verdict.HIDDEN
    if action is Action.VIEW or viewer.privileged:
        return Verdict.ALLOWED
    if action is Action.CONTROL and owner_id is not None and owner_id == viewer.member_id:
        return Verdict.ALLOWED
    return Verdict.DENIED


def may_set_endpoint(viewer: Viewer) -> bool:
    """Only admins and the workspace's owner choose where an agent's model requests go."""
    return viewer.privileged

"""Who may see a segment: the rule for conversations, in one place.

A segment from conversation G is shown for audience A only if every member
of A was a member of G when its run was archived (A ⊆ members(G)). A
segment from a task (no conversation) is the agent's own: it is shown in
the agent's scope and never in a person's workspace search. The stores
apply the same rule as a query (see `audience_id`); `visible` is the rule
itself, for one segment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable


def audience_id(members: Iterable[str]) -> str:
    """A stable id for a set of members (the same set always gets the same id)."""
    joined = "\n".join(sorted(set(members)))
    return hashlib.sha256(joined.encode()).hexdigest()[:32]


def visible(group_members: Collection[str] | None, audience: Collection[str], *, agent_scope: bool) -> bool:
    """Whether a segment may be shown.

    Args:
        group_members: the members of the segment's conversation as archived;
            None for a task's segment.
        audience: who will see the result (in a workspace search, the person).
        agent_scope: searching one agent's memory (else a workspace).
    """
    if group_members is None:
        return agent_scope
    return set(audience) <= set(group_members)

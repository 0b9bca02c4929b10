"""The runtime's access rules (services/runtime/domain/access.py), against the table."""

from __future__ import annotations

import uuid

import pytest

from services.runtime.domain.access import Action, Verdict, Viewer, decide, may_set_endpoint

WORKSPACE, ELSEWHERE = uuid.uuid4(), uuid.uuid4()
ME, SOMEONE = uuid.uuid4(), uuid.uuid4()

MEMBER = Viewer(ME, WORKSPACE, frozenset({"member"}))
ADMIN = Viewer(ME, WORKSPACE, frozenset({"admin"}))
OWNER = Viewer(ME, WORKSPACE, frozenset({"owner"}))
NO_ROLES = Viewer(ME, WORKSPACE, frozenset())

A, D, H = Verdict.ALLOWED, Verdict.DENIED, Verdict.HIDDEN

# viewer, the agent's owner, and the verdict for VIEW, CONTROL, SET_ENDPOINT.
TABLE = [
    ("member, own agent", MEMBER, ME, (A, A, D)),
    ("member, someone's agent", MEMBER, SOMEONE, (A, D, D)),
    ("member, agent without owner", MEMBER, None, (A, D, D)),
    ("token without roles, own agent", NO_ROLES, ME, (A, A, D)),
    ("admin, someone's agent", ADMIN, SOMEONE, (A, A, A)),
    ("admin, agent without owner", ADMIN, None, (A, A, A)),
    ("workspace owner, someone's agent", OWNER, SOMEONE, (A, A, A)),
]


@pytest.mark.parametrize(("case", "viewer", "owner", "verdicts"), TABLE, ids=[row[0] for row in TABLE])
def test_the_table(case: str, viewer: Viewer, owner: uuid.UUID | None, verdicts: tuple[Verdict, ...]) -> None:
    actions = (Action.VIEW, Action.CONTROL, Action.SET_ENDPOINT)
    found = tuple(decide(viewer, a, workspace_id=WORKSPACE, owner_id=owner) for a in actions)
    assert found == verdicts


@pytest.mark.parametrize("viewer", [MEMBER, ADMIN, OWNER])
def test_another_workspaces_agent_is_hidden_from_everyone(viewer: Viewer) -> None:
    for action in Action:
        assert decide(viewer, action, workspace_id=ELSEWHERE, owner_id=ME) is Verdict.HIDDEN


def test_only_admins_and_the_owner_set_model_endpoints() -> None:
    assert [may_set_endpoint(v) for v in (MEMBER, NO_ROLES, ADMIN, OWNER)] == [False, False, True, True]

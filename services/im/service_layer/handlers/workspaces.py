"""Workspaces: creating one with its owner (and the owner's account, when a
login is given), reading them."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.im.domain import access, rules
from services.im.domain.accounts import IssuedTokens
from services.im.domain.commands import CreateWorkspace
from services.im.domain.errors import InvalidRequest, NotFound
from services.im.domain.model import Member, MemberKind, Role, Workspace
from services.im.service_layer.handlers.auth_deps import (
    AuthDeps,
    Session,
    new_account,
    new_session,
    session_tokens,
    signed_in_again,
)
from services.im.service_layer.handlers.deps import (
    CreationHook,
    Deps,
    Page,
    member_actor,
    page_of,
    page_start,
)
from services.im.service_layer.ports import DuplicateRequest, Transaction


async def create_workspace(
    auth: AuthDeps, command: CreateWorkspace
) -> tuple[Workspace, Member, IssuedTokens | None]:
    """A workspace and its owner, with the owner's account and tokens if a login is given."""
    login, password, creator_kind = command.creator_login, command.creator_password, command.creator_kind
    if not login and not password:
        workspace, creator, _ = await open_workspace(auth.im, command)
        return workspace, creator, None
    if not login or not password:
        raise InvalidRequest("creator_login and creator_password go together")
    if creator_kind not in (None, MemberKind.HUMAN):
        raise InvalidRequest("only a HUMAN creator can have an account")
    key = access.normalize_login(login)
    access.check_password(password, auth.limits, field="creator_password")
    password_hash = await auth.passwords.hash(password)
    sessions: list[Session] = []

    async def add_account(tx: Transaction, workspace: Workspace, creator: Member) -> None:
        await tx.add_account(new_account(creator, auth.now(), login=key, password_hash=password_hash))
        sessions.append(await new_session(auth, tx, creator))

    workspace, creator, created = await open_workspace(
        auth.im, command, fingerprint_extra={"login": key}, within=add_account
    )
    if not created:
        # A retry: the first response (with its tokens) may have been lost.
        return workspace, creator, await signed_in_again(auth, creator, password)
    return workspace, creator, session_tokens(auth, creator, sessions[0])


async def open_workspace(
    deps: Deps,
    command: CreateWorkspace,
    *,
    fingerprint_extra: Mapping[str, str] | None = None,
    within: CreationHook | None = None,
) -> tuple[Workspace, Member, bool]:
    """Creates the workspace a command asks for with its creator, who owns it
    (the creator's login and password are `create_workspace`'s).

    Args:
        fingerprint_extra: more of the request that a retry with the
            same request_id must repeat (the creator's login).
        within: run in the creating transaction before it commits (the
            creator's account); not run when a retry finds the workspace.

    Returns:
        The workspace, its creator, and whether this call created them
        (False: an earlier call with the same request_id did).
    """
    name = rules.check_name(command.name, "name", required=True)
    display_name = rules.check_name(command.creator_display_name, "creator_display_name", required=True)
    avatar = rules.check_avatar(command.creator_avatar)
    kind = command.creator_kind or MemberKind.HUMAN
    rid = rules.check_request_id(command.request_id)
    fingerprint = rules.request_fingerprint(
        op="create_workspace",
        name=name,
        creator=display_name,
        kind=kind.value,
        avatar=avatar,
        **dict(fingerprint_extra or {}),
    )
    # With no actor yet, the request_id alone scopes the retry.
    scope = rules.NIL_SCOPE
    for attempt in range(2):
        async with deps.uow() as tx:
            existing = await deps.replay(tx, scope, rid, fingerprint)
            if existing is not None:
                workspace, creator = await _workspace_of_creator(tx, existing)
                return workspace, creator, False
            now = deps.clock()
            workspace = Workspace(id=uuid7(), name=name, created_at=now)
            creator = Member(
                id=uuid7(),
                workspace_id=workspace.id,
                kind=kind,
                display_name=display_name,
                avatar=avatar,
                created_at=now,
                role=Role.OWNER,
            )
            await tx.add_workspace(workspace)
            await tx.add_member(creator)
            await tx.add_audit(
                audit.succeeded(
                    None,
                    actor=member_actor(creator),
                    workspace_id=workspace.id,
                    action="CreateWorkspace",
                    target=audit.Target("workspace", str(workspace.id)),
                    at=now,
                    request_id=rid,
                    details={"name": name},
                )
            )
            if rid is not None:
                try:
                    await tx.remember_request(scope, rid, fingerprint, creator.id)
                except DuplicateRequest:
                    if attempt == 0:
                        continue
                    raise
            if within is not None:
                await within(tx, workspace, creator)
            await tx.commit()
            return workspace, creator, True
    raise AssertionError("unreachable")


async def _workspace_of_creator(tx: Transaction, creator_id: uuid.UUID) -> tuple[Workspace, Member]:
    creator = await tx.get_member(creator_id)
    workspace = await tx.get_workspace(creator.workspace_id) if creator is not None else None
    if creator is None or workspace is None:
        raise NotFound(f"the workspace of member {creator_id} was not found")
    return workspace, creator


async def get_workspace(deps: Deps, caller: Caller | None, workspace_id: str) -> Workspace:
    async with deps.uow(write=False) as tx:
        wanted = rules.parse_id(workspace_id, "workspace_id")
        resolved = await deps.caller_workspace(tx, caller, workspace_id)
        workspace = await tx.get_workspace(resolved)
        if workspace is None or resolved != wanted:
            raise NotFound(f"workspace {wanted} not found")
        return workspace


async def list_workspaces(
    deps: Deps, caller: Caller | None, *, page_size: int, page_token: str
) -> Page[Workspace]:
    limit = rules.page_size(page_size, deps.limits)
    after = page_start(page_token)
    async with deps.uow(write=False) as tx:
        ids: list[uuid.UUID] | None = None
        if caller is None or not caller.is_service:
            ids = [(await deps.acting_member(tx, caller)).workspace_id]
        items = await tx.list_workspaces(ids=ids, after=after, limit=limit + 1)
    return page_of(items, limit, lambda w: w.id)

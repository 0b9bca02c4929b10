"""Who may call each RPC of the IM (see docs/security.md, "Who may do what").

Which group, message or member a caller may touch is decided by the handlers.
Rules marked `audited` are privileged actions: their handlers record their
successes in the audit log, and `AuditInterceptor` their refusals.
"""

from __future__ import annotations

from agentim.im.v1 import auth_pb2, im_pb2
from services.common.authn import AGENT, HUMAN, Policy, Service, public, reads, writes

IM_SERVICE = im_pb2.DESCRIPTOR.services_by_name["IMService"].full_name
AUTH_SERVICE = auth_pb2.DESCRIPTOR.services_by_name["AuthService"].full_name
RUNTIME = Service("runtime")
MEMORY = Service("memory")

IM_POLICY = Policy.of_service(
    IM_SERVICE,
    {
        "CreateWorkspace": public(),
        "GetWorkspace": reads(HUMAN, AGENT),
        "ListWorkspaces": reads(HUMAN, AGENT, RUNTIME),
        "CreateMember": writes(HUMAN, RUNTIME).audited("member"),
        "GetMember": reads(HUMAN, AGENT, MEMORY),
        "ListMembers": reads(HUMAN, AGENT),
        "UpdateMember": writes(HUMAN, AGENT, RUNTIME).audited("member", "member.id"),
        "CreateGroup": writes(HUMAN, AGENT),
        "GetOrCreateDirectGroup": writes(HUMAN, AGENT),
        "GetGroup": reads(HUMAN, AGENT),
        "ListGroups": reads(HUMAN, AGENT),
        "UpdateGroup": writes(HUMAN, AGENT),
        "AddGroupMembers": writes(HUMAN, AGENT),
        "RemoveGroupMembers": writes(HUMAN, AGENT),
        "SendMessage": writes(HUMAN, AGENT),
        "EditMessage": writes(HUMAN, AGENT),
        "GetMessage": reads(HUMAN, AGENT),
        "ListMessages": reads(HUMAN, AGENT),
        "MarkRead": writes(HUMAN, AGENT),
        "GetAllUnread": reads(HUMAN, AGENT),
        "ListChats": reads(HUMAN, AGENT),
        "WatchEvents": reads(HUMAN, AGENT, RUNTIME),
        "SetAgentOwners": writes(RUNTIME).audited("member"),
    },
) | Policy.of_service(
    AUTH_SERVICE,
    {
        "GetSigningKeys": public(),
        "SignIn": public(),
        # Proves itself: an ID token the IM verifies, with its one-time nonce.
        "SignInWithOidc": public(),
        "LinkOidcAccount": writes(HUMAN).audited("member"),
        "RefreshTokens": public(),
        "SignOut": public(),
        "ChangePassword": writes(HUMAN).audited("member"),
        "CreateInvite": writes(HUMAN).audited("invite"),
        "AcceptInvite": public(),
        "SetMemberRole": writes(HUMAN).audited("member", "member_id"),
        "CreatePersonalToken": writes(HUMAN).audited("personal_token"),
        "ListPersonalTokens": reads(HUMAN),
        "RevokePersonalToken": writes(HUMAN).audited("personal_token", "personal_token_id"),
        "ExchangePersonalToken": public(),
        "IssueServiceToken": public(),
        "IssueAgentTokens": writes(RUNTIME),
        "ListAuditEvents": reads(HUMAN),
    },
)

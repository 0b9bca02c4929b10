"""The AuthService gRPC servicer: proto in, command or query, proto out."""

from __future__ import annotations

from typing import Any, TypeAlias

from agentim.im.v1 import auth_pb2, auth_pb2_grpc
from services.common.audit_proto import event_out, query_in
from services.common.authn import current_caller
from services.common.identity import Caller
from services.im.domain import commands
from services.im.entrypoints import auth_mappers as out
from services.im.entrypoints import mappers
from services.im.service_layer.handlers import audit_events, machine_access, sessions
from services.im.service_layer.handlers.auth_deps import AuthDeps
from services.im.service_layer.messagebus import MessageBus

# grpc.aio.ServicerContext; grpc has no type information.
Context: TypeAlias = Any


class AuthServicer(auth_pb2_grpc.AuthServiceServicer):
    """Thin translation between the wire and the identity handlers: commands
    go through the message bus, queries are direct calls.

    Args:
        bus: the IM's message bus.
        auth: what the identity queries read with.
    """

    def __init__(self, bus: MessageBus, auth: AuthDeps) -> None:
        self._bus = bus
        self._auth = auth

    async def _caller(self, context: Context) -> Caller | None:
        # Verified by the AuthenticationInterceptor before this handler ran.
        return current_caller()

    async def GetSigningKeys(
        self, request: auth_pb2.GetSigningKeysRequest, context: Context
    ) -> auth_pb2.GetSigningKeysResponse:
        return auth_pb2.GetSigningKeysResponse(
            keys=[out.signing_key(k) for k in sessions.signing_keys(self._auth)]
        )

    async def SignIn(self, request: auth_pb2.SignInRequest, context: Context) -> auth_pb2.SignInResponse:
        issued = await self._bus.handle(
            commands.SignIn(workspace_id=request.workspace_id, login=request.login, password=request.password)
        )
        return auth_pb2.SignInResponse(tokens=out.tokens(issued))

    async def SignInWithOidc(
        self, request: auth_pb2.SignInWithOidcRequest, context: Context
    ) -> auth_pb2.SignInWithOidcResponse:
        issued, joined = await self._bus.handle(
            commands.SignInWithOidc(
                id_token=request.id_token,
                nonce=request.nonce,
                workspace_id=request.workspace_id,
                invite=request.invite,
                display_name=request.display_name,
            )
        )
        return auth_pb2.SignInWithOidcResponse(tokens=out.tokens(issued), joined=joined)

    async def LinkOidcAccount(
        self, request: auth_pb2.LinkOidcAccountRequest, context: Context
    ) -> auth_pb2.LinkOidcAccountResponse:
        member, email = await self._bus.handle(
            commands.LinkOidcAccount(
                caller=await self._caller(context), id_token=request.id_token, nonce=request.nonce
            )
        )
        return auth_pb2.LinkOidcAccountResponse(member=mappers.member(member), email=email)

    async def RefreshTokens(
        self, request: auth_pb2.RefreshTokensRequest, context: Context
    ) -> auth_pb2.RefreshTokensResponse:
        issued = await self._bus.handle(commands.RefreshTokens(refresh_token=request.refresh_token))
        return auth_pb2.RefreshTokensResponse(tokens=out.tokens(issued))

    async def SignOut(self, request: auth_pb2.SignOutRequest, context: Context) -> auth_pb2.SignOutResponse:
        await self._bus.handle(commands.SignOut(refresh_token=request.refresh_token))
        return auth_pb2.SignOutResponse()

    async def ChangePassword(
        self, request: auth_pb2.ChangePasswordRequest, context: Context
    ) -> auth_pb2.ChangePasswordResponse:
        issued = await self._bus.handle(
            commands.ChangePassword(
                caller=await self._caller(context),
                old_password=request.old_password,
                new_password=request.new_password,
            )
        )
        return auth_pb2.ChangePasswordResponse(tokens=out.tokens(issued))

    async def CreateInvite(
        self, request: auth_pb2.CreateInviteRequest, context: Context
    ) -> auth_pb2.CreateInviteResponse:
        invite, secret = await self._bus.handle(
            commands.CreateInvite(
                caller=await self._caller(context),
                role=mappers.role(request.role),
                ttl=out.duration(request.ttl, "ttl") if request.HasField("ttl") else None,
                request_id=request.request_id,
                email=request.email,
            )
        )
        return auth_pb2.CreateInviteResponse(invite=out.invite(invite), secret=secret)

    async def AcceptInvite(
        self, request: auth_pb2.AcceptInviteRequest, context: Context
    ) -> auth_pb2.AcceptInviteResponse:
        issued = await self._bus.handle(
            commands.AcceptInvite(
                invite=request.invite,
                display_name=request.display_name,
                login=request.login,
                password=request.password,
                request_id=request.request_id,
            )
        )
        return auth_pb2.AcceptInviteResponse(tokens=out.tokens(issued))

    async def SetMemberRole(
        self, request: auth_pb2.SetMemberRoleRequest, context: Context
    ) -> auth_pb2.SetMemberRoleResponse:
        changed = await self._bus.handle(
            commands.SetMemberRole(
                caller=await self._caller(context),
                member_id=request.member_id,
                role=mappers.role(request.role),
            )
        )
        return auth_pb2.SetMemberRoleResponse(member=mappers.member(changed))

    async def CreatePersonalToken(
        self, request: auth_pb2.CreatePersonalTokenRequest, context: Context
    ) -> auth_pb2.CreatePersonalTokenResponse:
        token, secret = await self._bus.handle(
            commands.CreatePersonalToken(
                caller=await self._caller(context),
                name=request.name,
                scope=out.personal_token_scope(request.scope),
                expire_time=out.time(request.expire_time, "expire_time")
                if request.HasField("expire_time")
                else None,
                request_id=request.request_id,
            )
        )
        return auth_pb2.CreatePersonalTokenResponse(personal_token=out.personal_token(token), secret=secret)

    async def ListPersonalTokens(
        self, request: auth_pb2.ListPersonalTokensRequest, context: Context
    ) -> auth_pb2.ListPersonalTokensResponse:
        page = await machine_access.list_personal_tokens(
            self._auth,
            await self._caller(context),
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return auth_pb2.ListPersonalTokensResponse(
            personal_tokens=[out.personal_token(t) for t in page.items], next_page_token=page.next_token
        )

    async def RevokePersonalToken(
        self, request: auth_pb2.RevokePersonalTokenRequest, context: Context
    ) -> auth_pb2.RevokePersonalTokenResponse:
        token = await self._bus.handle(
            commands.RevokePersonalToken(
                caller=await self._caller(context), personal_token_id=request.personal_token_id
            )
        )
        return auth_pb2.RevokePersonalTokenResponse(personal_token=out.personal_token(token))

    async def ExchangePersonalToken(
        self, request: auth_pb2.ExchangePersonalTokenRequest, context: Context
    ) -> auth_pb2.ExchangePersonalTokenResponse:
        issued = await self._bus.handle(commands.ExchangePersonalToken(secret=request.secret))
        assert issued.member is not None
        return auth_pb2.ExchangePersonalTokenResponse(
            access_token=issued.token,
            access_expire_time=out.access_expiry(issued),
            member=mappers.member(issued.member),
        )

    async def IssueServiceToken(
        self, request: auth_pb2.IssueServiceTokenRequest, context: Context
    ) -> auth_pb2.IssueServiceTokenResponse:
        issued = await self._bus.handle(
            commands.IssueServiceToken(service=request.service, secret=request.secret)
        )
        return auth_pb2.IssueServiceTokenResponse(
            access_token=issued.token, access_expire_time=out.access_expiry(issued)
        )

    async def IssueAgentTokens(
        self, request: auth_pb2.IssueAgentTokensRequest, context: Context
    ) -> auth_pb2.IssueAgentTokensResponse:
        issued = await self._bus.handle(
            commands.IssueAgentTokens(
                caller=await self._caller(context), agent_member_ids=list(request.agent_member_ids)
            )
        )
        return auth_pb2.IssueAgentTokensResponse(
            agent_tokens=[
                auth_pb2.AgentToken(
                    member_id=str(i.member.id) if i.member is not None else "",
                    access_token=i.token,
                    access_expire_time=out.access_expiry(i),
                )
                for i in issued
            ]
        )

    async def ListAuditEvents(
        self, request: auth_pb2.ListAuditEventsRequest, context: Context
    ) -> auth_pb2.ListAuditEventsResponse:
        records, token = await audit_events.list_audit_events(
            self._auth,
            await self._caller(context),
            query_in(request.query),
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return auth_pb2.ListAuditEventsResponse(
            audit_events=[event_out(r, service="im") for r in records], next_page_token=token
        )

"""The IMService gRPC servicer: proto in, handler call, proto out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

from agentim.im.v1 import im_pb2, im_pb2_grpc
from services.common.authn import current_caller
from services.common.identity import WATCH_START_CURSOR_KEY, Caller
from services.im.domain import commands
from services.im.entrypoints import auth_mappers, mappers
from services.im.service_layer.events import EventFeed
from services.im.service_layer.handlers import groups, members, messages, read_state, workspaces
from services.im.service_layer.handlers.deps import Deps
from services.im.service_layer.messagebus import MessageBus

# grpc.aio.ServicerContext; grpc has no type information.
Context: TypeAlias = Any


class IMServicer(im_pb2_grpc.IMServiceServicer):
    """Thin translation between the wire and the IM's handlers: commands go
    through the message bus, queries are direct calls."""

    def __init__(self, bus: MessageBus, deps: Deps, feed: EventFeed) -> None:
        self._bus = bus
        self._deps = deps
        self._feed = feed

    def _caller(self, context: Context) -> Caller | None:
        # Verified by the AuthenticationInterceptor before this handler ran.
        return current_caller()

    async def CreateWorkspace(
        self, request: im_pb2.CreateWorkspaceRequest, context: Context
    ) -> im_pb2.CreateWorkspaceResponse:
        workspace, creator, tokens = await self._bus.handle(
            commands.CreateWorkspace(
                name=request.name,
                creator_display_name=request.creator_display_name,
                creator_kind=mappers.member_kind(request.creator_kind),
                creator_avatar=request.creator_avatar,
                request_id=request.request_id,
                creator_login=request.creator_login,
                creator_password=request.creator_password,
            )
        )
        response = im_pb2.CreateWorkspaceResponse(
            workspace=mappers.workspace(workspace), creator=mappers.member(creator)
        )
        if tokens is not None:
            response.tokens.CopyFrom(auth_mappers.tokens(tokens))
        return response

    async def GetWorkspace(
        self, request: im_pb2.GetWorkspaceRequest, context: Context
    ) -> im_pb2.GetWorkspaceResponse:
        found = await workspaces.get_workspace(self._deps, self._caller(context), request.workspace_id)
        return im_pb2.GetWorkspaceResponse(workspace=mappers.workspace(found))

    async def ListWorkspaces(
        self, request: im_pb2.ListWorkspacesRequest, context: Context
    ) -> im_pb2.ListWorkspacesResponse:
        page = await workspaces.list_workspaces(
            self._deps, self._caller(context), page_size=request.page_size, page_token=request.page_token
        )
        return im_pb2.ListWorkspacesResponse(
            workspaces=[mappers.workspace(w) for w in page.items], next_page_token=page.next_token
        )

    async def CreateMember(
        self, request: im_pb2.CreateMemberRequest, context: Context
    ) -> im_pb2.CreateMemberResponse:
        created = await self._bus.handle(
            commands.CreateMember(
                caller=self._caller(context),
                workspace_id=request.workspace_id,
                kind=mappers.member_kind(request.kind),
                display_name=request.display_name,
                avatar=request.avatar,
                request_id=request.request_id,
                owner_id=request.owner_id,
            )
        )
        return im_pb2.CreateMemberResponse(member=mappers.member(created))

    async def GetMember(self, request: im_pb2.GetMemberRequest, context: Context) -> im_pb2.GetMemberResponse:
        found = await members.get_member(self._deps, self._caller(context), request.member_id)
        return im_pb2.GetMemberResponse(member=mappers.member(found))

    async def ListMembers(
        self, request: im_pb2.ListMembersRequest, context: Context
    ) -> im_pb2.ListMembersResponse:
        page = await members.list_members(
            self._deps,
            self._caller(context),
            workspace_id=request.workspace_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return im_pb2.ListMembersResponse(
            members=[mappers.member(m) for m in page.items], next_page_token=page.next_token
        )

    async def UpdateMember(
        self, request: im_pb2.UpdateMemberRequest, context: Context
    ) -> im_pb2.UpdateMemberResponse:
        updated = await self._bus.handle(
            commands.UpdateMember(
                caller=self._caller(context),
                member_id=request.member.id,
                display_name=request.member.display_name,
                avatar=request.member.avatar,
                fields=list(request.update_mask.paths),
            )
        )
        return im_pb2.UpdateMemberResponse(member=mappers.member(updated))

    async def CreateGroup(
        self, request: im_pb2.CreateGroupRequest, context: Context
    ) -> im_pb2.CreateGroupResponse:
        created = await self._bus.handle(
            commands.CreateGroup(
                caller=self._caller(context),
                name=request.name,
                member_ids=list(request.member_ids),
                request_id=request.request_id,
            )
        )
        return im_pb2.CreateGroupResponse(group=mappers.group(created))

    async def GetOrCreateDirectGroup(
        self, request: im_pb2.GetOrCreateDirectGroupRequest, context: Context
    ) -> im_pb2.GetOrCreateDirectGroupResponse:
        found, created = await self._bus.handle(
            commands.GetOrCreateDirectGroup(
                caller=self._caller(context), peer_member_id=request.peer_member_id
            )
        )
        return im_pb2.GetOrCreateDirectGroupResponse(group=mappers.group(found), created=created)

    async def GetGroup(self, request: im_pb2.GetGroupRequest, context: Context) -> im_pb2.GetGroupResponse:
        found = await groups.get_group(self._deps, self._caller(context), request.group_id)
        return im_pb2.GetGroupResponse(group=mappers.group(found))

    async def ListGroups(
        self, request: im_pb2.ListGroupsRequest, context: Context
    ) -> im_pb2.ListGroupsResponse:
        page = await groups.list_groups(
            self._deps,
            self._caller(context),
            member_id=request.member_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return im_pb2.ListGroupsResponse(
            groups=[mappers.group(g) for g in page.items], next_page_token=page.next_token
        )

    async def UpdateGroup(
        self, request: im_pb2.UpdateGroupRequest, context: Context
    ) -> im_pb2.UpdateGroupResponse:
        updated = await self._bus.handle(
            commands.RenameGroup(
                caller=self._caller(context),
                group_id=request.group.id,
                name=request.group.name,
                fields=list(request.update_mask.paths),
            )
        )
        return im_pb2.UpdateGroupResponse(group=mappers.group(updated))

    async def AddGroupMembers(
        self, request: im_pb2.AddGroupMembersRequest, context: Context
    ) -> im_pb2.AddGroupMembersResponse:
        updated = await self._bus.handle(
            commands.AddGroupMembers(
                caller=self._caller(context), group_id=request.group_id, member_ids=list(request.member_ids)
            )
        )
        return im_pb2.AddGroupMembersResponse(group=mappers.group(updated))

    async def RemoveGroupMembers(
        self, request: im_pb2.RemoveGroupMembersRequest, context: Context
    ) -> im_pb2.RemoveGroupMembersResponse:
        updated = await self._bus.handle(
            commands.RemoveGroupMembers(
                caller=self._caller(context), group_id=request.group_id, member_ids=list(request.member_ids)
            )
        )
        return im_pb2.RemoveGroupMembersResponse(group=mappers.group(updated))

    async def SendMessage(
        self, request: im_pb2.SendMessageRequest, context: Context
    ) -> im_pb2.SendMessageResponse:
        sent = await self._bus.handle(
            commands.SendMessage(
                caller=self._caller(context),
                group_id=request.group_id,
                content_type=mappers.content_type(request.content_type),
                content=request.content,
                mentions=list(request.mentions),
                reply_to_message_id=request.reply_to_message_id,
                metadata=mappers.metadata(request.metadata),
                request_id=request.request_id,
            )
        )
        return im_pb2.SendMessageResponse(message=mappers.message(sent))

    async def EditMessage(
        self, request: im_pb2.EditMessageRequest, context: Context
    ) -> im_pb2.EditMessageResponse:
        edited = await self._bus.handle(
            commands.EditMessage(
                caller=self._caller(context), message_id=request.message_id, content=request.content
            )
        )
        return im_pb2.EditMessageResponse(message=mappers.message(edited))

    async def GetMessage(
        self, request: im_pb2.GetMessageRequest, context: Context
    ) -> im_pb2.GetMessageResponse:
        found = await messages.get_message(self._deps, self._caller(context), request.message_id)
        return im_pb2.GetMessageResponse(message=mappers.message(found))

    async def ListMessages(
        self, request: im_pb2.ListMessagesRequest, context: Context
    ) -> im_pb2.ListMessagesResponse:
        page = await messages.list_messages(
            self._deps,
            self._caller(context),
            group_id=request.group_id,
            page_size=request.page_size,
            page_token=request.page_token,
            before_message_id=request.before_message_id,
            after_message_id=request.after_message_id,
        )
        return im_pb2.ListMessagesResponse(
            messages=[mappers.message(m) for m in page.items], next_page_token=page.next_token
        )

    async def MarkRead(self, request: im_pb2.MarkReadRequest, context: Context) -> im_pb2.MarkReadResponse:
        state = await self._bus.handle(
            commands.MarkRead(
                caller=self._caller(context),
                group_id=request.group_id,
                up_to_message_id=request.up_to_message_id,
            )
        )
        return im_pb2.MarkReadResponse(read_state=mappers.read_state(state))

    async def GetAllUnread(
        self, request: im_pb2.GetAllUnreadRequest, context: Context
    ) -> im_pb2.GetAllUnreadResponse:
        found, remaining = await read_state.get_all_unread(
            self._deps, self._caller(context), page_size=request.page_size
        )
        return im_pb2.GetAllUnreadResponse(
            messages=[mappers.message(m) for m in found], remaining_count=remaining
        )

    async def ListChats(self, request: im_pb2.ListChatsRequest, context: Context) -> im_pb2.ListChatsResponse:
        page = await read_state.list_chats(
            self._deps, self._caller(context), page_size=request.page_size, page_token=request.page_token
        )
        return im_pb2.ListChatsResponse(
            chats=[mappers.chat(c) for c in page.items], next_page_token=page.next_token
        )

    async def WatchEvents(
        self, request: im_pb2.WatchEventsRequest, context: Context
    ) -> AsyncIterator[im_pb2.WatchEventsResponse]:
        deliveries = await self._feed.watch(
            self._caller(context),
            member_ids=list(request.member_ids),
            workspace_id=request.workspace_id,
            after_cursor=request.after_cursor,
        )
        try:
            # Headers now tell the client the subscription is in place: events
            # committed from here on will reach it, and after which cursor.
            await context.send_initial_metadata(((WATCH_START_CURSOR_KEY, deliveries.start_cursor),))
            async for delivery in deliveries:
                yield mappers.delivery(delivery)
        finally:
            await deliveries.aclose()

    async def SetAgentOwners(
        self, request: im_pb2.SetAgentOwnersRequest, context: Context
    ) -> im_pb2.SetAgentOwnersResponse:
        changed = await self._bus.handle(
            commands.SetAgentOwners(
                caller=self._caller(context),
                owners=[(o.agent_member_id, o.owner_id) for o in request.agent_owners],
            )
        )
        return im_pb2.SetAgentOwnersResponse(changed_count=changed)

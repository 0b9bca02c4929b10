"""The IM port over the IM service's gRPC API.

The runtime calls with its own credentials: a call made as an agent carries
that agent's AGENT access token, any other its SERVICE access token
(`services.common.service_auth`); the IM gives the runtime tokens for the
agents it hosts and for no one else, so the runtime never acts as a person
or as another service's agent. Refusals come back as `IMError` carrying the
IM's status code and its readable message; an IM that cannot be reached
within the deadline, or that has not given the runtime its token yet, is
`IMUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC
from typing import Any

import grpc
from google.protobuf import field_mask_pb2, json_format
from google.rpc import error_details_pb2, status_pb2

from agentim.im.v1 import im_pb2, im_pb2_grpc
from services.common import errors
from services.common.clients import make_channel
from services.common.identity import WATCH_START_CURSOR_KEY, bearer_metadata
from services.common.ratelimit import retry_after_seconds
from services.common.service_auth import AgentTokens, AuthClient, SecretSource, ServiceToken, TokenRefused
from services.common.status import status_name
from services.common.tls import ClientTls
from services.runtime.domain.errors import IMError, IMUnavailable
from services.runtime.service_layer.im_port import IMEvent, IMGroup, IMMember, IMMessage, IMPort

logger = logging.getLogger(__name__)

# A call that ends CANCELLED was not cancelled by us (our own cancellation
# raises CancelledError, never a status): the channel or the IM dropped it,
# as grpc does under overload. Like an unreachable IM, it is worth a retry.
# A SendMessage over the IM's rate limit (with a request id, so safe to
# repeat) is sent again after the wait the IM names, this many times, if that
# wait is at most this long; otherwise the refusal is the caller's.
RATE_LIMIT_RETRIES = 5
RATE_LIMIT_MAX_WAIT_SECONDS = 5.0
_UNREACHABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# A watch stream that fails with one of these is reopened from its last
# cursor: the IM went away or was overloaded, or it (or a proxy) cancelled
# the stream. A cancellation of our own never arrives here as a status.
_WATCH_RETRYABLE = _UNREACHABLE | {
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Lists of members and groups are read whole, in pages as large as the IM
# allows (it clamps the size); the page count bounds a runaway paging loop.
_LIST_PAGE_SIZE = 1000
_MAX_PAGES = 1000


class GrpcIM(IMPort):
    """`IMPort` over a gRPC channel to the IM service.

    Args:
        address: host:port of the IM service.
        service_secret: where the runtime's credential comes from; it is
            exchanged for the runtime's access token, which gets the tokens
            of its agents.
        deadline_seconds: deadline of every unary call.
        reconnect_initial_seconds: first wait before a watch stream is
            reopened (and the channel's first reconnect backoff).
        reconnect_max_seconds: longest wait between reopen attempts; the
            wait doubles (with jitter) after each failed attempt.
        max_message_bytes: largest message sent or received.
        max_concurrent_calls: unary calls in flight at once; more wait their
            turn (one grpc.aio channel cancels calls beyond about a thousand).
        service_name: the name the IM knows this service by (`runtime`).
    """

    def __init__(
        self,
        address: str,
        *,
        service_secret: SecretSource,
        deadline_seconds: float = 10.0,
        reconnect_initial_seconds: float = 0.2,
        reconnect_max_seconds: float = 10.0,
        max_message_bytes: int = 4 * 1024 * 1024,
        max_concurrent_calls: int = 256,
        tls: ClientTls | None = None,
        service_name: str = "runtime",
    ) -> None:
        if deadline_seconds <= 0:
            raise ValueError("deadline_seconds must be positive")
        if not 0 < reconnect_initial_seconds <= reconnect_max_seconds:
            raise ValueError("need 0 < reconnect_initial_seconds <= reconnect_max_seconds")
        self._address = address
        self._deadline = deadline_seconds
        self._initial_backoff = reconnect_initial_seconds
        self._max_backoff = reconnect_max_seconds
        # Built by hand rather than with `open_channel`, which takes no options:
        # the channel's own reconnect backoff (by default up to two minutes)
        # must follow ours, or a watch would stay blind long after the IM is back.
        # Every unary call passes its deadline itself.
        self._channel = make_channel(
            address,
            tls=tls,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", max(1, int(reconnect_initial_seconds * 1000))),
                ("grpc.max_reconnect_backoff_ms", max(1, int(reconnect_max_seconds * 1000))),
            ],
        )
        self._stub = im_pb2_grpc.IMServiceStub(self._channel)
        self.auth = AuthClient(self._channel, deadline_seconds=deadline_seconds)
        self.service_token = ServiceToken(
            service=service_name, secret=service_secret, issue=self.auth.service_token
        )
        self.agent_tokens = AgentTokens(issue=self.auth.agent_tokens, service=self.service_token)
        self._calls = asyncio.Semaphore(max_concurrent_calls)
        self._closed = False

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to the IM (the runtime also fetches the IM's signing keys over it)."""
        return self._channel

    async def __aenter__(self) -> GrpcIM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the channel; running watches end. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.agent_tokens.aclose()
        await self._channel.close()

    # -- plumbing -----------------------------------------------------------

    async def _metadata(self, as_member: uuid.UUID | None = None) -> tuple[tuple[str, str], ...]:
        """The agent's token for a call made as an agent this runtime hosts, its
        own for a call made as itself.

        Raises:
            IMError: UNAUTHENTICATED: the IM refused the runtime's credential,
                or `as_member` is no agent the runtime hosts (the runtime
                holds no other member's token).
            IMUnavailable: the IM is away, or the credential is not there yet
                (the embedded IM writes it on its first start).
        """
        try:
            token = own = await self.service_token.get()
            if own is not None and as_member is not None:
                token = await self.agent_tokens.get(as_member)
        except TokenRefused as refused:
            raise _refused(
                grpc.StatusCode.UNAUTHENTICATED, f"the IM refused the runtime's credential: {refused}"
            ) from None
        except errors.Unavailable as away:
            raise _unavailable(f"the IM at {self._address} is unavailable: {away}") from None
        if own is None:
            raise _unavailable(
                f"the runtime has no credential for the IM at {self._address} yet"
                " (RUNTIME_SERVICE_SECRET or RUNTIME_SERVICE_SECRET_FILE)"
            )
        if token is None:
            raise _refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"the runtime has no access token for member {as_member}:"
                " it acts only as the agents it hosts",
            )
        return bearer_metadata(token)

    async def _watch_metadata(self, workspace_id: uuid.UUID) -> tuple[tuple[str, str], ...] | None:
        """The runtime's token for a watch; None once the client is closed.

        While the IM is away, or has not given the runtime its token yet,
        waits (backing off as the watch does) and asks again.
        """
        backoff = self._initial_backoff
        level = logging.WARNING
        while not self._closed:
            try:
                return await self._metadata()
            except IMUnavailable as away:
                logger.log(
                    level, "watch of workspace %s waits for the runtime's token: %s", workspace_id, away
                )
                level = logging.DEBUG
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, self._max_backoff)
        return None

    async def _call(self, rpc: Callable[..., Any], request: Any, as_member: uuid.UUID | None = None) -> Any:
        if self._closed:
            raise IMUnavailable(f"the IM client for {self._address} is closed")
        try:
            async with self._calls:
                metadata = await self._metadata(as_member)
                return await rpc(request, metadata=metadata, timeout=self._deadline)
        except grpc.aio.AioRpcError as error:
            raise self._error(error) from None

    def _error(self, error: grpc.aio.AioRpcError) -> IMError:
        code = error.code()
        details = error.details() or code.name
        if code in _UNREACHABLE:
            unreachable = IMUnavailable(f"the IM at {self._address} is unavailable ({code.name}): {details}")
            return unreachable
        refused = _refused(code, details)
        # A quota the IM ran into is the runtime caller's too (CreateAgent over the agents' quota).
        refused.quota_violation = quota_violation(error.trailing_metadata())
        refused.retry_after_seconds = retry_after_seconds(error.trailing_metadata())
        return refused

    # -- members ------------------------------------------------------------

    async def create_agent_member(
        self,
        workspace_id: uuid.UUID,
        display_name: str,
        *,
        avatar: str = "",
        request_id: str = "",
        owner_id: uuid.UUID | None = None,
    ) -> IMMember:
        response = await self._call(
            self._stub.CreateMember,
            im_pb2.CreateMemberRequest(
                kind=im_pb2.MEMBER_KIND_AGENT,
                display_name=display_name,
                avatar=avatar,
                request_id=request_id,
                workspace_id=str(workspace_id),
                owner_id=str(owner_id) if owner_id is not None else "",
            ),
        )
        return _member(response.member)

    async def set_agent_owners(self, owners: dict[uuid.UUID, uuid.UUID]) -> int:
        pairs = [im_pb2.AgentOwner(agent_member_id=str(a), owner_id=str(o)) for a, o in owners.items()]
        changed = 0
        # The IM takes at most 100 a call.
        for start in range(0, len(pairs), 100):
            response = await self._call(
                self._stub.SetAgentOwners,
                im_pb2.SetAgentOwnersRequest(agent_owners=pairs[start : start + 100]),
            )
            changed += response.changed_count
        return changed

    async def rename_member(self, member_id: uuid.UUID, display_name: str) -> IMMember:
        # The agent renames itself: the IM lets a member update only itself.
        response = await self._call(
            self._stub.UpdateMember,
            im_pb2.UpdateMemberRequest(
                member=im_pb2.Member(id=str(member_id), display_name=display_name),
                update_mask=field_mask_pb2.FieldMask(paths=["display_name"]),
            ),
            as_member=member_id,
        )
        return _member(response.member)

    async def get_member(self, as_member: uuid.UUID, member_id: uuid.UUID) -> IMMember:
        response = await self._call(
            self._stub.GetMember, im_pb2.GetMemberRequest(member_id=str(member_id)), as_member=as_member
        )
        return _member(response.member)

    async def list_members(self, as_member: uuid.UUID) -> list[IMMember]:
        members: list[IMMember] = []
        token = ""
        for _ in range(_MAX_PAGES):
            response = await self._call(
                self._stub.ListMembers,
                im_pb2.ListMembersRequest(page_size=_LIST_PAGE_SIZE, page_token=token),
                as_member=as_member,
            )
            members.extend(_member(m) for m in response.members)
            token = response.next_page_token
            if not token:
                break
        return members

    # -- read state -----------------------------------------------------------

    async def get_all_unread(self, as_member: uuid.UUID, *, limit: int = 200) -> list[IMMessage]:
        response = await self._call(
            self._stub.GetAllUnread, im_pb2.GetAllUnreadRequest(page_size=limit), as_member=as_member
        )
        return [_message(m) for m in response.messages]

    async def mark_read(self, as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        await self._call(
            self._stub.MarkRead,
            im_pb2.MarkReadRequest(group_id=str(group_id), up_to_message_id=str(up_to)),
            as_member=as_member,
        )

    # -- messages -------------------------------------------------------------

    async def send_message(
        self,
        as_member: uuid.UUID,
        group_id: uuid.UUID,
        content: str,
        *,
        mentions: Sequence[uuid.UUID] = (),
        reply_to: uuid.UUID | None = None,
        request_id: str = "",
        content_type: str = "text",
        metadata: Mapping[str, Any] | None = None,
    ) -> IMMessage:
        request = im_pb2.SendMessageRequest(
            group_id=str(group_id),
            content_type=im_pb2.ContentType.Value(f"CONTENT_TYPE_{content_type.upper()}"),
            content=content,
            mentions=[str(m) for m in mentions],
            reply_to_message_id=str(reply_to) if reply_to is not None else "",
            request_id=request_id,
        )
        if metadata:
            request.metadata.update(dict(metadata))
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._call(self._stub.SendMessage, request, as_member=as_member)
                return _message(response.message)
            except IMError as refused:
                # An agent over the IM's sending rate waits as it is told and
                # sends again: the request id keeps a retry from sending twice.
                wait = refused.retry_after_seconds
                if (
                    not request_id
                    or status_name(refused) != "RESOURCE_EXHAUSTED"
                    or wait is None
                    or wait > RATE_LIMIT_MAX_WAIT_SECONDS
                    or attempt > RATE_LIMIT_RETRIES
                ):
                    raise
                await asyncio.sleep(max(wait, 0.005))

    async def get_message(self, as_member: uuid.UUID, message_id: uuid.UUID) -> IMMessage:
        response = await self._call(
            self._stub.GetMessage, im_pb2.GetMessageRequest(message_id=str(message_id)), as_member=as_member
        )
        return _message(response.message)

    async def list_messages(
        self, as_member: uuid.UUID, group_id: uuid.UUID, *, limit: int = 50, before: uuid.UUID | None = None
    ) -> list[IMMessage]:
        response = await self._call(
            self._stub.ListMessages,
            im_pb2.ListMessagesRequest(
                group_id=str(group_id),
                page_size=limit,
                before_message_id=str(before) if before is not None else "",
            ),
            as_member=as_member,
        )
        # The IM returns pages oldest first.
        return [_message(m) for m in response.messages]

    # -- groups ---------------------------------------------------------------

    async def get_or_create_direct_group(self, as_member: uuid.UUID, peer_id: uuid.UUID) -> IMGroup:
        response = await self._call(
            self._stub.GetOrCreateDirectGroup,
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=str(peer_id)),
            as_member=as_member,
        )
        return _group(response.group)

    async def get_group(self, as_member: uuid.UUID, group_id: uuid.UUID) -> IMGroup:
        response = await self._call(
            self._stub.GetGroup, im_pb2.GetGroupRequest(group_id=str(group_id)), as_member=as_member
        )
        return _group(response.group)

    async def list_groups(self, as_member: uuid.UUID) -> list[IMGroup]:
        groups: list[IMGroup] = []
        token = ""
        for _ in range(_MAX_PAGES):
            response = await self._call(
                self._stub.ListGroups,
                im_pb2.ListGroupsRequest(page_size=_LIST_PAGE_SIZE, page_token=token),
                as_member=as_member,
            )
            groups.extend(_group(g) for g in response.groups)
            token = response.next_page_token
            if not token:
                break
        return groups

    async def create_group(
        self, as_member: uuid.UUID, name: str, member_ids: Sequence[uuid.UUID], *, request_id: str = ""
    ) -> IMGroup:
        response = await self._call(
            self._stub.CreateGroup,
            im_pb2.CreateGroupRequest(
                name=name, member_ids=[str(m) for m in member_ids], request_id=request_id
            ),
            as_member=as_member,
        )
        return _group(response.group)

    # -- events ---------------------------------------------------------------

    async def watch(
        self,
        workspace_id: uuid.UUID,
        *,
        member_ids: Sequence[uuid.UUID] = (),
        after_cursor: str = "",
        on_subscribed: Callable[[str], object] | None = None,
    ) -> AsyncIterator[IMEvent]:
        """Message-created events of a workspace; see `IMPort.watch`.

        Args:
            workspace_id: the workspace to watch, as the service itself.
            member_ids: watch only these members' groups (members of
                `workspace_id`); empty watches the whole workspace.
            after_cursor: resume after this cursor; empty starts at the live end.
            on_subscribed: called each time the IM confirms a (re)opened
                stream is subscribed, with the cursor it starts after, so
                that a caller starting at the live end knows from when on
                nothing is missed.

        Raises:
            IMError: the IM refused the watch (an unknown workspace, a
                malformed cursor, a wrong service token...), or the
                watched members are not of `workspace_id`.
            IMUnavailable: the client is closed.
        """
        if self._closed:
            raise IMUnavailable(f"the IM client for {self._address} is closed")
        # The IM takes either a workspace or members (whose workspace it finds).
        watched_members = [str(m) for m in member_ids]
        scope = "" if watched_members else str(workspace_id)
        cursor = after_cursor
        backoff = self._initial_backoff
        failures = 0
        chain = _Chain(_sequence(cursor))
        while True:
            if (metadata := await self._watch_metadata(workspace_id)) is None:
                return  # closed meanwhile
            call = self._stub.WatchEvents(
                im_pb2.WatchEventsRequest(
                    workspace_id=scope, member_ids=watched_members, after_cursor=cursor
                ),
                metadata=metadata,
            )
            try:
                headers = await call.initial_metadata()
                if not call.done():
                    # The IM sends its headers once the subscription is in place,
                    # saying where it starts: resume from there, not from "now",
                    # if the stream breaks before any event arrives.
                    cursor = cursor or _header(headers, WATCH_START_CURSOR_KEY)
                    chain.start(_sequence(cursor))
                    if failures:
                        logger.info("watch of workspace %s reopened after cursor %r", workspace_id, cursor)
                    backoff = self._initial_backoff
                    failures = 0
                    if on_subscribed is not None:
                        on_subscribed(cursor)
                while (response := await call.read()) is not grpc.aio.EOF:
                    cursor = response.cursor
                    event = _event(response, workspace_id, chain)
                    if event is not None:
                        yield event
                reason = "the IM ended the stream"
            except grpc.aio.AioRpcError as error:
                if self._closed:
                    return
                if error.code() not in _WATCH_RETRYABLE:
                    raise self._error(error) from None
                reason = f"{error.code().name}: {error.details()}"
            except asyncio.CancelledError:
                # Closing the channel cancels its calls; that ends the watch
                # quietly. A cancelled consumer is cancelled all the same.
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    return
                raise
            finally:
                call.cancel()
            if self._closed:
                return
            # Equal jitter: replicas of the runtime do not all come back at once.
            delay = backoff * (0.5 + random.random() / 2)
            failures += 1
            logger.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "watch of workspace %s interrupted (%s); reopening after cursor %r in %.2f s",
                workspace_id,
                reason,
                cursor,
                delay,
            )
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, self._max_backoff)


def _event(response: im_pb2.WatchEventsResponse, workspace_id: uuid.UUID, chain: _Chain) -> IMEvent | None:
    """The event to pass on (message-created events only), its place in the chain noted."""
    chain.saw(response.sequence, response.previous_sequence)
    if response.WhichOneof("event") != "message_created":
        return None
    message = response.message_created.message
    if message.workspace_id != str(workspace_id):
        # Cursors are per workspace: resuming one with another's would skip events.
        raise _refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the watched members are not members of workspace {workspace_id}",
        )
    return IMEvent(
        cursor=response.cursor,
        message=_message(message),
        member_ids=tuple(uuid.UUID(m) for m in response.member_ids),
        sequence=response.sequence,
        previous_sequence=chain.pass_on(response.sequence),
    )


def quota_violation(trailing_metadata: Any) -> errors.QuotaViolation | None:
    """The first `google.rpc.QuotaFailure` violation of a status's details, if any."""
    for key, value in trailing_metadata or ():
        if key != "grpc-status-details-bin":
            continue
        for item in status_pb2.Status.FromString(value).details:
            if item.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                failure = error_details_pb2.QuotaFailure()
                item.Unpack(failure)
                for violation in failure.violations:
                    return errors.QuotaViolation(subject=violation.subject, description=violation.description)
    return None


def _refused(code: grpc.StatusCode, message: str) -> IMError:
    error = IMError(message)
    error.relayed_status = code.name
    return error


def _unavailable(message: str) -> IMUnavailable:
    return IMUnavailable(message)


# -- proto to port -------------------------------------------------------------


def _enum_name(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


def _member(proto: im_pb2.Member) -> IMMember:
    return IMMember(
        id=uuid.UUID(proto.id),
        workspace_id=uuid.UUID(proto.workspace_id),
        kind=_enum_name(im_pb2.MemberKind.Name(proto.kind), "MEMBER_KIND_"),
        display_name=proto.display_name,
    )


def _group(proto: im_pb2.Group) -> IMGroup:
    return IMGroup(
        id=uuid.UUID(proto.id),
        name=proto.name,
        kind=_enum_name(im_pb2.GroupKind.Name(proto.kind), "GROUP_KIND_"),
        member_ids=tuple(uuid.UUID(m) for m in proto.member_ids),
    )


def _message(proto: im_pb2.Message) -> IMMessage:
    return IMMessage(
        id=uuid.UUID(proto.id),
        group_id=uuid.UUID(proto.group_id),
        sender_id=uuid.UUID(proto.sender_id),
        content_type=_enum_name(im_pb2.ContentType.Name(proto.content_type), "CONTENT_TYPE_"),
        content=proto.content,
        mentions=tuple(uuid.UUID(m) for m in proto.mentions),
        sent_at=proto.send_time.ToDatetime(tzinfo=UTC),
        reply_to=uuid.UUID(proto.reply_to_message_id) if proto.reply_to_message_id else None,
        metadata=json_format.MessageToDict(proto.metadata) if proto.HasField("metadata") else None,
    )


def _header(metadata: Any, key: str) -> str:
    for name, value in metadata or ():
        if name == key:
            return str(value)
    return ""


def _sequence(cursor: str) -> int | None:
    """The sequence number of an IM cursor (the IM's cursors are its numbers); None if not one."""
    return int(cursor) if cursor.isascii() and cursor.isdigit() else None


class _Chain:
    """The chain of an event stream's sequence numbers, as the watch passes events on.

    Each event names the one the IM sent before it on the stream
    (`previous_sequence`), the other kinds of event included, which are not
    passed on. An event passed on names the last one passed on, if the IM's
    chain since is unbroken, and -1 (a gap, to its consumer) if not.
    """

    def __init__(self, start: int | None) -> None:
        self._passed_on = self._seen = start
        self._unbroken = True

    def start(self, sequence: int | None) -> None:
        """The stream starts after `sequence` (known only once the IM says, for a watch from now)."""
        if self._passed_on is None:
            self._passed_on = self._seen = sequence

    def saw(self, sequence: int, previous: int) -> None:
        self._unbroken = self._unbroken and self._seen is not None and previous == self._seen
        self._seen = sequence

    def pass_on(self, sequence: int) -> int:
        """The previous sequence to give the event passed on."""
        previous = self._passed_on if self._unbroken and self._passed_on is not None else -1
        self._passed_on, self._unbroken = sequence, True
        return previous

"""The audit log at the edges of a service: refusals recorded by an
interceptor, and old records pruned on a long timer (see `services.common.audit`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import grpc

from services.common.audit import (
    NOT_RECORDED,
    AuditLog,
    AuditRecord,
    AuditSettings,
    Target,
    actor_of,
    refused,
)
from services.common.authn import Policy, current_caller, identified_caller
from services.common.errors import ServiceError
from services.common.identity import Caller
from services.common.outages import unavailable_error
from services.common.status import status_name

logger = logging.getLogger(__name__)


# -- the boundary: refusals -------------------------------------------------------


def _field(message: Any, path: str) -> str:
    value: Any = message
    for part in path.split("."):
        value = getattr(value, part, "")
    return value if isinstance(value, str) else ""


class AuditInterceptor(grpc.aio.ServerInterceptor):
    """Records the refusals and failures of the RPCs the policy marks `audited`.

    It wraps authentication (place it before the `AuthenticationInterceptor`
    in the list, after the error mapping that `GrpcServer` puts first), so
    that it sees the caller's refusals there too. Only calls whose caller is
    verified and has a workspace are recorded (an unknown token could name
    any workspace); successes are the handlers' to record, with their change.

    Args:
        policy: the service's rules; those with `audit` are watched.
        log: where refusals go.
        settings: the window in which refusals are counted together.
        clock: current time.
    """

    def __init__(
        self,
        policy: Policy,
        log: AuditLog,
        *,
        settings: AuditSettings,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._audited = {
            method: rule.audit for method, rule in policy.rules.items() if rule.audit is not None
        }
        self._log = log
        self._window = settings.refusal_window
        self._clock = clock

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        spec = self._audited.get(method)
        if handler is None or spec is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        action = method.rsplit("/", 1)[-1]

        async def audited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(request, context)
            except Exception as error:
                target = Target(
                    spec.target_kind, _field(request, spec.target_field) if spec.target_field else ""
                )
                request_id = _field(request, "request_id")
                await self._refused(error, action=action, target=target, request_id=request_id)
                raise

        return grpc.unary_unary_rpc_method_handler(
            audited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _refused(self, error: Exception, *, action: str, target: Target, request_id: str) -> None:
        record = refusal_record(
            error,
            current_caller() or identified_caller(),
            action=action,
            target=target,
            request_id=request_id,
            at=self._clock(),
        )
        if record is None:
            return
        try:
            await self._log.record_refusal(record, window=self._window)
        except Exception:
            # The caller gets its refusal all the same; the log says the record is missing.
            logger.warning("could not record a refused %s in the audit log", action, exc_info=True)


def refusal_record(
    error: BaseException,
    caller: Caller | None,
    *,
    action: str,
    target: Target,
    request_id: str,
    at: datetime,
) -> AuditRecord | None:
    """The record of an audited call that raised `error`, or None if it is not recorded.

    Recorded: refusals and failures of a caller whose workspace its verified
    token names. Not recorded: calls with no such caller (anyone may send a
    token naming any workspace, or none), and outcomes that say the service
    could not answer (UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED).
    """
    if isinstance(error, grpc.aio.AbortError) or unavailable_error(error) is not None:
        return None
    if isinstance(error, ServiceError):
        code, reason = status_name(error), error.message
    else:
        code, reason = "INTERNAL", "internal error"
    if code in NOT_RECORDED:
        return None
    workspace = caller.claims.workspace_id if caller is not None else None
    if workspace is None:
        return None
    return refused(
        actor_of(caller),
        workspace_id=workspace,
        action=action,
        target=target,
        at=at,
        code=code,
        reason=reason,
        request_id=request_id,
    )


# -- retention ------------------------------------------------------------------------


class AuditPruner:
    """Deletes records past the retention, at start and then every `interval`.

    Args:
        log: the records.
        settings: retention (None: nothing is pruned) and interval.
        clock: current time.
    """

    def __init__(
        self,
        log: AuditLog,
        settings: AuditSettings,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._log = log
        self._settings = settings
        self._clock = clock
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._settings.retention is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="audit-pruner")

    async def prune_once(self) -> int:
        retention = self._settings.retention
        if retention is None:
            return 0
        return await self._log.prune(before=self._clock() - retention)

    async def _run(self) -> None:
        interval = self._settings.prune_interval.total_seconds()
        while not self._stop.is_set():
            try:
                pruned = await self.prune_once()
                if pruned:
                    logger.info("pruned %d audit records past the retention", pruned)
            except Exception:
                logger.warning("could not prune the audit log; trying again later", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    async def aclose(self) -> None:
        """Stops pruning. Idempotent."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

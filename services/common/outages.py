"""Which failures mean "a dependency cannot serve now": the one place that decides.

A lost or refused connection, a database that is shutting down, locked,
out of resources or unable to read its files, Redis gone: nothing is wrong
with the request or with the code, and the same call may work in a moment,
so callers get gRPC `UNAVAILABLE`. Anything else (a SQL error, a broken
constraint the code did not expect) is a bug and stays `INTERNAL`.

Adapters raise `DependencyUnavailable` at their boundary (`as_unavailable`),
so that the service layer sees a typed error (the runtime's runners back off
on `errors.Unavailable`); the error-mapping interceptor asks `unavailable_error`
the same question about anything that reaches it untyped.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import redis.exceptions
import sqlalchemy.exc

from services.common import errors

DATABASE = "the database"
REDIS = "Redis"
# What the interceptor names when the failure itself does not say which dependency it was.
_SOME_DEPENDENCY = "a service this one depends on"

LOST = "connection lost"
REFUSED = "connection refused"
TIMED_OUT = "timed out"


class DependencyUnavailable(errors.Unavailable):
    """A dependency (the database, Redis) cannot serve now; try again later.

    Attributes:
        dependency: what failed, as a reader would name it ("the database").
        reason: why, in a few words ("connection lost", "database is locked").
        connection_lost: the connection in use broke (as opposed to a refusal,
            a timeout or a busy database): an idempotent read may go again at
            once on another connection.
    """

    def __init__(self, dependency: str, reason: str, *, connection_lost: bool = False) -> None:
        super().__init__(f"{dependency} is unavailable ({reason}); try again")
        self.dependency = dependency
        self.reason = reason
        self.connection_lost = connection_lost


@dataclass(frozen=True, slots=True)
class _Outage:
    reason: str
    dependency: str | None = None
    connection_lost: bool = False


def unavailable_error(error: BaseException, *, dependency: str | None = None) -> DependencyUnavailable | None:
    """The `DependencyUnavailable` that `error` amounts to, or None if it means something else.

    Args:
        error: any exception, looked at together with its causes (SQLAlchemy
            wraps the driver's exception, which may wrap a socket error).
        dependency: what the caller was talking to, when the error alone may
            not say (a bare socket error inside a database call).
    """
    if isinstance(error, DependencyUnavailable):
        return error
    if isinstance(error, errors.ServiceError):
        return None  # already says what it is
    outage = _classify(error)
    if outage is None:
        return None
    return DependencyUnavailable(
        outage.dependency or dependency or _SOME_DEPENDENCY,
        outage.reason,
        connection_lost=outage.connection_lost,
    )


def describe(error: BaseException) -> str:
    """The innermost cause's own words, for the log: the driver's message,
    without the statement and parameters SQLAlchemy adds (which may hold
    what people wrote)."""
    innermost = error
    for each in _chain(error):
        innermost = each
    return str(innermost) or type(innermost).__name__


@contextlib.contextmanager
def as_unavailable(dependency: str) -> Iterator[None]:
    """Raises `DependencyUnavailable` (from the original) for an outage of `dependency`
    inside the block; anything else passes through untouched."""
    try:
        yield
    except Exception as error:
        unavailable = unavailable_error(error, dependency=dependency)
        if unavailable is None or unavailable is error:
            raise
        raise unavailable from error


def _classify(error: BaseException) -> _Outage | None:
    for each in _chain(error):
        outage = _classify_one(each)
        if outage is not None:
            return outage
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error, then what it wraps (SQLAlchemy's `orig`, explicit causes), each once.

    Not `__context__`: an error raised while handling another is not
    necessarily caused by it.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending and len(seen) < 16:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for inner in (getattr(current, "orig", None), current.__cause__):
            if isinstance(inner, BaseException):
                pending.append(inner)


# SQLite's primary result codes that say the database cannot serve now.
_SQLITE_OUTAGES = {
    5,  # SQLITE_BUSY: "database is locked" (another writer held on longer than the busy timeout)
    6,  # SQLITE_LOCKED
    7,  # SQLITE_NOMEM
    8,  # SQLITE_READONLY: the file or its directory cannot be written
    10,  # SQLITE_IOERR: "disk I/O error"
    13,  # SQLITE_FULL
    14,  # SQLITE_CANTOPEN: "unable to open database file"
    15,  # SQLITE_PROTOCOL
}
# PostgreSQL SQLSTATE classes and codes that say the server cannot serve now:
# connection exceptions, insufficient resources (too many connections, disk
# full, out of memory), system errors (I/O), and shutdowns or start-ups.
_PG_OUTAGE_CLASSES = {"08": LOST, "53": "out of resources", "58": "system error"}
_PG_OUTAGE_CODES = {
    "08001": REFUSED,  # sqlclient_unable_to_establish_sqlconnection
    "08004": REFUSED,  # sqlserver_rejected_establishment_of_sqlconnection
    "57P01": "shutting down",  # admin_shutdown (also pg_terminate_backend)
    "57P02": "crashed",  # crash_shutdown
    "57P03": "starting up or shutting down",  # cannot_connect_now
    "57P05": "idle too long",  # idle_session_timeout
}
_UNREACHABLE_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.EHOSTUNREACH,
    errno.EHOSTDOWN,
    errno.ETIMEDOUT,
}


def _classify_one(error: BaseException) -> _Outage | None:
    if isinstance(error, DependencyUnavailable):
        return _Outage(error.reason, error.dependency, error.connection_lost)
    # SQLAlchemy: the pool found no connection in time, or the connection broke.
    if isinstance(error, sqlalchemy.exc.TimeoutError):
        return _Outage("no connection free in time", DATABASE)
    if isinstance(error, sqlalchemy.exc.DisconnectionError):
        return _Outage(LOST, DATABASE, connection_lost=True)
    if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
        return _Outage(LOST, DATABASE, connection_lost=True)
    # asyncpg (and any driver that reports a SQLSTATE).
    sqlstate = getattr(error, "sqlstate", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        if sqlstate in _PG_OUTAGE_CODES:
            reason = _PG_OUTAGE_CODES[sqlstate]
            return _Outage(reason, DATABASE, connection_lost=reason != REFUSED)
        if sqlstate[:2] in _PG_OUTAGE_CLASSES:
            return _Outage(_PG_OUTAGE_CLASSES[sqlstate[:2]], DATABASE, connection_lost=sqlstate[:2] == "08")
    if isinstance(error, asyncpg.exceptions.InterfaceError) and "connection is closed" in str(error):
        # "cannot call Connection.fetch(): connection is closed": raised before anything was sent.
        return _Outage(LOST, DATABASE, connection_lost=True)
    if isinstance(error, asyncpg.exceptions.InternalClientError):
        # The protocol of this connection broke, as when the server's notice
        # that it terminates the connection arrives before the socket closes
        # ("cannot switch to state 11; another operation (2) is in progress").
        return _Outage(LOST, DATABASE, connection_lost=True)
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in _SQLITE_OUTAGES:
            return _Outage(str(error) or "SQLite error", DATABASE)
        return None
    if isinstance(error, redis.exceptions.TimeoutError):
        return _Outage(TIMED_OUT, REDIS)
    if isinstance(error, redis.exceptions.ConnectionError):
        return _Outage(LOST, REDIS, connection_lost=True)
    return _socket_outage(error)


def _socket_outage(error: BaseException) -> _Outage | None:
    if isinstance(error, ConnectionRefusedError):
        return _Outage(REFUSED)
    if isinstance(error, ConnectionError):  # reset, aborted, broken pipe
        return _Outage(LOST, connection_lost=True)
    if isinstance(error, TimeoutError):
        return _Outage(TIMED_OUT)
    if isinstance(error, socket.gaierror):
        return _Outage("host name not found")
    if isinstance(error, OSError):
        if error.errno in _UNREACHABLE_ERRNOS:
            return _Outage("unreachable")
        # asyncio's create_connection, when every address of a host failed.
        if error.errno is None and str(error).startswith("Multiple exceptions:"):
            return _Outage("unreachable")
    return None

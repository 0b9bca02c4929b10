"""Agent events as JSON, for the replicas that relay them to each other.

The domain's events are frozen dataclasses of plain values (ids, times,
enums, tuples, other such dataclasses): each is written as an object tagged
with its class name and read back by its field types. Only the classes an
`Emitted` can hold are read (nothing else can be made from a message), a
field a newer replica added is ignored and one it dropped takes its default,
so replicas of two versions side by side during a rolling update still
understand each other.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
import uuid
from datetime import datetime
from functools import cache
from typing import Any

from services.runtime.domain.model import Emitted

_TAG = "type"


class UnreadableEvent(ValueError):
    """A message that is not an event this replica knows."""


def encode(emitted: Emitted) -> dict[str, Any]:
    """The event as a JSON-able object."""
    encoded: dict[str, Any] = _encode(emitted)
    return encoded


def decode(value: Any) -> Emitted:
    """The event a JSON-able object holds.

    Raises:
        UnreadableEvent: it is not an event of a known kind.
    """
    decoded = _decode(Emitted, value)
    if not isinstance(decoded, Emitted):
        raise UnreadableEvent("not an agent event")
    return decoded


def _encode(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {_TAG: type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = _encode(getattr(value, f.name))
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    return value


def _decode(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        if isinstance(value, dict):
            return _dataclass(value)
        plain = [a for a in typing.get_args(hint) if a is not type(None)]
        return _decode(plain[0], value)
    if origin is tuple:
        if not isinstance(value, list):
            raise UnreadableEvent(f"expected a list, got {type(value).__name__}")
        item = typing.get_args(hint)[0]
        return tuple(_decode(item, v) for v in value)
    try:
        if hint is uuid.UUID:
            return uuid.UUID(value)
        if hint is datetime:
            return datetime.fromisoformat(value)
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return hint(value)
    except (TypeError, ValueError) as error:
        raise UnreadableEvent(f"a bad {getattr(hint, '__name__', hint)}: {error}") from None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(value)
    return value


def _dataclass(value: Any) -> Any:
    if not isinstance(value, dict):
        raise UnreadableEvent(f"expected an object, got {type(value).__name__}")
    cls = _readable().get(str(value.get(_TAG)))
    if cls is None:
        raise UnreadableEvent(f"unknown kind {value.get(_TAG)!r}")
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{name: _decode(hints[name], v) for name, v in value.items() if name in known})
    except TypeError as error:  # a field without a default is missing
        raise UnreadableEvent(f"a bad {cls.__name__}: {error}") from None


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def _readable() -> dict[str, type]:
    """The dataclasses an `Emitted` can hold, by name: all the codec may make."""
    found: dict[str, type] = {}

    def visit(hint: Any) -> None:
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if hint.__name__ in found:
                return
            found[hint.__name__] = hint
            for field_hint in _hints(hint).values():
                visit(field_hint)
            return
        for arg in typing.get_args(hint):
            visit(arg)

    visit(Emitted)
    return found

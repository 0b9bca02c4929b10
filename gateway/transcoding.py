"""JSON and query strings to protobuf requests, protobuf responses to JSON (pure).

Only `google.protobuf.json_format` reads and writes JSON (the proto3 JSON
mapping: lowerCamelCase names, enums by name, 64-bit integers as strings),
so the gateway holds no copy of any schema. Path and query parameters are
set on the parsed message through its descriptor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from gateway.errors import HttpError, bad_request

_INTEGER_TYPES = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED32,
    FieldDescriptor.TYPE_SFIXED64,
}
_FLOAT_TYPES = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}


def _field(descriptor: Descriptor, name: str) -> FieldDescriptor | None:
    """A field by its proto name or its JSON (lowerCamelCase) name."""
    found = descriptor.fields_by_name.get(name)
    if found is not None:
        return found
    for candidate in descriptor.fields:
        if candidate.json_name == name:
            return candidate
    return None


def resolve(descriptor: Descriptor, dotted: str) -> list[FieldDescriptor]:
    """The chain of fields a dotted name (`member.id`) walks; the last one is scalar.

    Raises:
        HttpError: 400 when a name is unknown or does not end on a scalar field.
    """
    chain: list[FieldDescriptor] = []
    current: Descriptor | None = descriptor
    parts = dotted.split(".")
    for index, part in enumerate(parts):
        found = _field(current, part) if current is not None else None
        if found is None:
            raise bad_request(f"unknown parameter {dotted!r}")
        last = index == len(parts) - 1
        # A Timestamp is given as one RFC 3339 string, as grpc-gateway takes it.
        is_message = found.type == FieldDescriptor.TYPE_MESSAGE and not _is_timestamp(found)
        if last == is_message or (not last and _is_repeated(found)):
            raise bad_request(f"parameter {dotted!r} does not name a scalar field")
        chain.append(found)
        current = found.message_type
    return chain


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def _is_timestamp(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.full_name == "google.protobuf.Timestamp"


def convert(field: FieldDescriptor, name: str, text: str) -> Any:
    """A parameter's text as a value of the field's type.

    Raises:
        HttpError: 400 when the text is not a value of that type.
    """
    kind = field.type
    try:
        if kind in _INTEGER_TYPES:
            return int(text, 10)
        if kind in _FLOAT_TYPES:
            return float(text)
    except ValueError:
        raise bad_request(f"parameter {name!r}: expected a number, got {text[:64]!r}") from None
    if kind == FieldDescriptor.TYPE_BOOL:
        if text in {"true", "1"}:
            return True
        if text in {"false", "0"}:
            return False
        raise bad_request(f"parameter {name!r}: expected true or false, got {text[:64]!r}")
    if kind == FieldDescriptor.TYPE_ENUM and field.enum_type is not None:
        enum_type = field.enum_type
        value = enum_type.values_by_name.get(text)
        if value is None and text.lstrip("-").isdigit():
            value = enum_type.values_by_number.get(int(text))
        if value is None:
            names = ", ".join(v.name for v in enum_type.values)
            raise bad_request(f"parameter {name!r}: expected one of {names}, got {text[:64]!r}")
        return value.number
    if kind == FieldDescriptor.TYPE_BYTES:
        return text.encode()
    return text


def set_param(message: Message, name: str, values: list[str]) -> None:
    """Sets the (possibly nested, possibly repeated) scalar field `name` from parameter values.

    Raises:
        HttpError: 400 for an unknown field, a wrong type, or several
            values for a single field.
    """
    descriptor: Any = message.DESCRIPTOR
    chain = resolve(descriptor, name)
    target = message
    for step in chain[:-1]:
        target = getattr(target, step.name)
    leaf = chain[-1]
    if _is_timestamp(leaf) and not _is_repeated(leaf):
        if len(values) != 1:
            raise bad_request(f"parameter {name!r} given more than once")
        try:
            getattr(target, leaf.name).FromJsonString(values[0])
        except ValueError:
            raise bad_request(
                f"parameter {name!r}: expected an RFC 3339 time (2026-01-31T12:00:00Z),"
                f" got {values[0][:64]!r}"
            ) from None
        return
    converted = [convert(leaf, name, v) for v in values]
    try:
        if _is_repeated(leaf):
            getattr(target, leaf.name).extend(converted)
            return
        if len(converted) != 1:
            raise bad_request(f"parameter {name!r} given more than once")
        setattr(target, leaf.name, converted[0])
    except (ValueError, TypeError) as error:
        raise bad_request(f"parameter {name!r}: {error}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(message: Message, body: bytes) -> None:
    """Merges a JSON body (the request message in the proto3 JSON mapping) into `message`.

    An empty body is an empty message. Unknown fields are refused.

    Raises:
        HttpError: 400 with the parser's message.
    """
    if not body.strip():
        return
    try:
        document = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise bad_request(f"malformed JSON: {error}") from None
    if not isinstance(document, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        json_format.ParseDict(document, message, ignore_unknown_fields=False)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as error:
        raise bad_request(str(error)) from None


def build_request(
    message: Message,
    *,
    body: bytes | None,
    query: Iterable[tuple[str, str]],
    path_params: Mapping[str, str],
    skip: Iterable[str] = (),
) -> Message:
    """Fills a request message: the body first, then query parameters, then path parameters.

    Args:
        message: an empty request message.
        body: the JSON body (POST/PATCH), or None.
        query: query parameters in order (a name may repeat); for GET/DELETE.
        path_params: decoded path parameters; they win over the body.
        skip: query parameter names that are not request fields.
    """
    if body is not None:
        parse_body(message, body)
    skipped = set(skip)
    grouped: dict[str, list[str]] = {}
    for name, value in query:
        if name not in skipped:
            grouped.setdefault(name, []).append(value)
    for name, values in grouped.items():
        set_param(message, name, values)
    for name, value in path_params.items():
        set_param(message, name, [value])
    return message


def to_json(message: Message) -> dict[str, Any]:
    """A message in the proto3 JSON mapping, fields with default values included."""
    document: dict[str, Any] = json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
    return document


def dumps(document: Any) -> str:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


def message_json(message: Message) -> str:
    return dumps(to_json(message))


__all__ = ["HttpError", "build_request", "dumps", "message_json", "parse_body", "set_param", "to_json"]

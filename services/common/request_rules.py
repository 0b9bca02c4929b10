"""Rules every request of every service obeys, checked from the message's descriptor.

Whatever a client sends is stored, compared or echoed somewhere, and some
values are not storable or not meaningful anywhere: a NUL character
(PostgreSQL's text refuses it), a lone surrogate (not UTF-8), a number that
is not finite (JSON has no NaN or Infinity), an enum number the API does not
define (proto3 enums are open, so unknown numbers arrive as they are), or
JSON nested deeper than anything reads back safely. These rules hold for
every field, so they are checked once, generically, by walking the request
(`services.common.interceptors.RequestRulesInterceptor` does it for every
RPC); what a particular field means (lengths, required fields, ranges) stays
in each context's domain rules.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from services.common.errors import InvalidArgument

# google.protobuf.Struct nests three messages per JSON level (Struct, its map
# entry, Value); the protobuf parser gives up at 100 nested messages, about 33
# JSON levels. Refusing past 32 keeps every JSON value well inside what the
# parser, the JSON encoder and the databases' JSON types take.
MAX_JSON_DEPTH = 32

_STRUCT = "google.protobuf.Struct"
_LIST_VALUE = "google.protobuf.ListValue"
_VALUE = "google.protobuf.Value"
_FLOATS = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}
# Anything that cannot be stored as UTF-8 text: NUL and UTF-16 surrogates.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_SHOWN_KEY_CHARS = 40
_SHOWN_PATH_CHARS = 200


def check_request(message: Message, *, max_json_depth: int = MAX_JSON_DEPTH) -> None:
    """Checks every field of a request against the rules every service shares.

    Raises:
        InvalidArgument: naming the first field that breaks a rule.
    """
    _Walker(max_json_depth).message(message, "")


def check_text(value: str, where: str) -> None:
    """Refuses text with a NUL character or a lone surrogate (not valid UTF-8).

    Raises:
        InvalidArgument: naming `where`.
    """
    found = _UNSTORABLE.search(value)
    if found is None:
        return
    if found.group() == "\x00":
        raise InvalidArgument(f"{_shorten(where)} contains a NUL character")
    raise InvalidArgument(f"{_shorten(where)} is not valid UTF-8 (it contains a lone surrogate)")


def _shorten(where: str) -> str:
    # A path into deep JSON can be long; its start and its end say enough.
    if len(where) <= _SHOWN_PATH_CHARS:
        return where
    return f"{where[: _SHOWN_PATH_CHARS // 2]}...{where[-_SHOWN_PATH_CHARS // 2 :]}"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _key(key: Any) -> str:
    # Keys are the client's text: shown short, and escaped so that a NUL or
    # a control character never reaches a log line or a status as it is.
    return json.dumps(str(key)[:_SHOWN_KEY_CHARS])


class _Walker:
    def __init__(self, max_json_depth: int) -> None:
        self._max_json_depth = max_json_depth
        self._json_root = ""  # the field whose JSON is being walked

    def message(self, message: Message, path: str) -> None:
        descriptor = message.DESCRIPTOR
        if descriptor.full_name in (_STRUCT, _LIST_VALUE, _VALUE):
            self._json_root = path or "request"
            if descriptor.full_name == _STRUCT:
                self._struct(message, self._json_root, 1)
            elif descriptor.full_name == _LIST_VALUE:
                self._list(message, self._json_root, 1)
            else:
                self._json(message, self._json_root, 0)
            return
        for field, value in message.ListFields():
            where = _join(path, field.name)
            entry = field.message_type
            if entry is not None and entry.GetOptions().map_entry:
                key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
                for key, item in value.items():
                    shown = f"{where}[{_key(key)}]"
                    self.value(key_field, key, f"key of {shown}")
                    self.value(value_field, item, shown)
            elif field.is_repeated:
                for index, item in enumerate(value):
                    self.value(field, item, f"{where}[{index}]")
            else:
                self.value(field, value, where)

    def value(self, field: FieldDescriptor, value: Any, where: str) -> None:
        kind = field.type
        if kind == FieldDescriptor.TYPE_STRING:
            check_text(value, where)
        elif kind in _FLOATS:
            if not math.isfinite(value):
                raise InvalidArgument(f"{_shorten(where)} must be a finite number, got {value}")
        elif kind == FieldDescriptor.TYPE_ENUM:
            enum_type = field.enum_type
            if enum_type is not None and value not in enum_type.values_by_number:
                raise InvalidArgument(f"{_shorten(where)}: {value} is not a known {enum_type.name}")
        elif kind == FieldDescriptor.TYPE_MESSAGE:
            self.message(value, where)

    # google.protobuf.Struct, ListValue and Value: JSON inside protobuf.

    def _struct(self, struct: Message, where: str, depth: int) -> None:
        self._depth(depth)
        for key, item in struct.fields.items():  # type: ignore[attr-defined]
            shown = f"{where}[{_key(key)}]"
            check_text(key, f"key of {shown}")
            self._json(item, shown, depth)

    def _list(self, values: Message, where: str, depth: int) -> None:
        self._depth(depth)
        for index, item in enumerate(values.values):  # type: ignore[attr-defined]
            self._json(item, f"{where}[{index}]", depth)

    def _json(self, value: Message, where: str, depth: int) -> None:
        kind = value.WhichOneof("kind")
        if kind == "number_value":
            number = value.number_value  # type: ignore[attr-defined]
            if not math.isfinite(number):
                raise InvalidArgument(f"{_shorten(where)} must be a finite number (JSON has no {number})")
        elif kind == "string_value":
            check_text(value.string_value, where)  # type: ignore[attr-defined]
        elif kind == "struct_value":
            self._struct(value.struct_value, where, depth + 1)  # type: ignore[attr-defined]
        elif kind == "list_value":
            self._list(value.list_value, where, depth + 1)  # type: ignore[attr-defined]

    def _depth(self, depth: int) -> None:
        if depth > self._max_json_depth:
            raise InvalidArgument(f"{self._json_root} is nested deeper than {self._max_json_depth} levels")

"""A coordinator message as plain JSON values, for `murmur admin ... --output json` and /api/status.

protobuf's JSON mapping writes 64-bit integers as strings (JavaScript's numbers hold 53 bits);
tokens, bytes and offsets of a run stay far below 2**53, so here they are JSON numbers, and an
event's ``detail`` (a JSON object in a string field, coordinator.proto) is the object itself.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

_WIDE = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
_JSON_TEXT_FIELDS = {"detail"}  # string fields that hold a JSON object


def message_json(message: Message) -> dict[str, Any]:
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _plain(message.DESCRIPTOR, data)
    return data


def _plain(descriptor: Descriptor, data: dict[str, Any]) -> None:
    for field in descriptor.fields:
        value = data.get(field.name)
        if value is None:
            continue
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            entry = kind.fields_by_name["value"]
            for key, item in value.items():
                if entry.message_type is not None:
                    _plain(entry.message_type, item)
                elif entry.type in _WIDE:
                    value[key] = int(item)
        elif kind is not None:
            for item in value if isinstance(value, list) else [value]:
                _plain(kind, item)
        elif field.type in _WIDE:
            data[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.name in _JSON_TEXT_FIELDS and isinstance(value, str):
            data[field.name] = _object(value)


def _object(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text  # not JSON after all: shown as written

"""Hypothesis strategies for any protobuf message, read from its descriptor.

Every field may be left unset or given a value of its type, with the values a boundary should refuse drawn
often: NaN, infinities, -0.0 and the extremes of each number type; empty, long and non-UTF-8-looking text;
random and oversized bytes; enum numbers no contract defines; empty and long repeated fields. Nested
messages are drawn to a bounded depth, one member of each oneof at most. ``raw_bytes`` is a request that is
not a message at all.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

MAX_DEPTH = 3
LONG = 70_000  # over the 64 KiB a sane field of these APIs holds

F = FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_EDGES = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 1e308, -1e308, 1e-45, 0.5, 2.0]


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, 0, 1, -1, 2, 16, 512, 513, 2**31 - 1, 2**32 - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(0, 64), st.integers(lo, hi))


def _scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t])
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.one_of(st.sampled_from(_FLOAT_EDGES), st.floats(width=32 if t == F.TYPE_FLOAT else 64))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * LONG, "\x00", "../../etc", "ünï"]))
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=48), st.sampled_from([b"", b"\x00" * 16, b"\xff" * LONG]))
    if t == F.TYPE_ENUM:
        return st.sampled_from([*(v.number for v in field.enum_type.values), 99, -1])
    if t == F.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    raise TypeError(f"unhandled protobuf field type {t}")


def _values(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key, depth), _scalar(value, depth), max_size=4)
    if field.is_repeated:
        one = _scalar(field, depth)
        return st.one_of(st.lists(one, max_size=6), st.lists(one, min_size=200, max_size=400))
    return _scalar(field, depth)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type (empty past ``MAX_DEPTH``)."""
    cls = GetMessageClass(descriptor)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    in_oneof = {f.name for o in descriptor.oneofs for f in o.fields}
    plain = {f.name: st.none() | _values(f, depth) for f in descriptor.fields if f.name not in in_oneof}
    oneofs = [
        st.none() | st.sampled_from(list(o.fields)).flatmap(lambda f: st.tuples(st.just(f.name), _values(f, depth)))
        for o in descriptor.oneofs
    ]
    return st.builds(_build, st.just(cls), st.fixed_dictionaries(plain), st.tuples(*oneofs))


def _build(cls: type[Message], plain: dict[str, Any], chosen: tuple[tuple[str, Any] | None, ...]) -> Message:
    msg = cls()
    for name, value in [*plain.items(), *(c for c in chosen if c is not None)]:
        if value is not None:
            _set(msg, name, value)
    return msg


def _set(msg: Message, name: str, value: Any) -> None:
    """Set what the Python runtime accepts (it refuses some values the wire could carry: those are sent
    as raw bytes instead)."""
    field = getattr(msg, name)
    try:
        if isinstance(value, Message):
            field.CopyFrom(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, Message):
                    field[k].CopyFrom(v)
                else:
                    field[k] = v
        elif isinstance(value, list):
            field.extend(value)
        else:
            setattr(msg, name, value)
    except (TypeError, ValueError, OverflowError):
        pass


def raw_bytes() -> st.SearchStrategy[bytes]:
    """Requests that are not a message of any type (or, by chance, an odd one)."""
    return st.one_of(st.binary(max_size=64), st.sampled_from([b"\xff" * 32, b"\x0a\xff\xff\xff\xff\x0f", b"\x08"]))


def mutations(template: Message) -> st.SearchStrategy[Message]:
    """``template`` (a valid request) with one field given a drawn value: one of its own fields, or one
    of a sub-message it sets (its sampling settings, its hand-off). Reaches what a request wrong in one
    place only exercises: the checks after the first ones, and the engine."""
    d = template.DESCRIPTOR
    nested = [f for f in d.fields if f.message_type is not None and not f.is_repeated and template.HasField(f.name)]
    paths = [(f,) for f in d.fields] + [(f, g) for f in nested for g in f.message_type.fields]
    return st.sampled_from(paths).flatmap(lambda path: _values(path[-1], 1).map(lambda v: _mutated(template, path, v)))


def _mutated(template: Message, path: tuple[FieldDescriptor, ...], value: Any) -> Message:
    msg = type(template)()
    msg.CopyFrom(template)
    target = msg
    for f in path[:-1]:
        target = getattr(target, f.name)
    target.ClearField(path[-1].name)
    _set(target, path[-1].name, value)
    return msg

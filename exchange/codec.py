"""SEE codec: msgspec encode/decode with the checks the wire types cannot express.

Build one ``Encoder`` and one ``Decoder`` per socket and reuse them (msgspec compiles
the schema once per decoder). A *frame* (one ZeroMQ message) is a msgpack array of
encoded messages, so many small messages cost one socket operation; ``Encoder.frame``
builds it and ``Decoder.decode_frame`` takes it apart, keeping each item's raw bytes
so a broker can forward or log them without re-encoding.

Every way a message can be bad raises a subclass of ``DecodeError`` whose ``field``
names the field (or ``"frame"``) and whose text is one sentence. Receivers count these
and keep running; they never reach application code as exceptions.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any, Union

import msgspec
import numpy as np

from exchange.protocol import (
    FLOAT_DTYPE,
    LINK_TYPES,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Experience,
)

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024  # a frame (batch) larger than this is rejected unread

_TAG_TO_TYPE: dict[str, type] = {t.__struct_config__.tag: t for t in (*MESSAGE_TYPES, *LINK_TYPES)}
_PATH_INDEX = re.compile(r"\$\[(\d+)\]")


class DecodeError(ValueError):
    """A message or frame that cannot be accepted; ``field`` names where it went wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Malformed(DecodeError):
    """Not valid msgpack, or not a frame (array of messages)."""


class Truncated(DecodeError):
    """The bytes end in the middle of a value."""


class TooLarge(DecodeError):
    """Over the configured size cap."""


class SchemaMismatch(DecodeError):
    """Valid msgpack, but not one of the expected message types (wrong type, wrong shape)."""


class SchemaTooNew(DecodeError):
    """Written by a newer protocol version than this reader understands."""


class NonFinite(DecodeError):
    """NaN or infinity where a finite number is required."""


class BadArray(DecodeError):
    """A packed array whose byte length does not fit its dtype, or arrays whose lengths disagree."""


class InvalidValue(DecodeError):
    """A value outside its documented range (e.g. sample_index >= group_size)."""


def _float_fields(t: type) -> tuple[str, ...]:
    return tuple(f.name for f in msgspec.structs.fields(t) if f.type is float)


_FLOAT_FIELDS: dict[type, tuple[str, ...]] = {t: _float_fields(t) for t in (*MESSAGE_TYPES, *LINK_TYPES)}


def validate(msg: Any) -> None:
    """Checks a decoded (or about to be encoded) message beyond its types; raises ``DecodeError``."""
    schema = msg.schema
    if schema != SCHEMA_VERSION:
        check_schema(schema)
    if type(msg) is Experience:  # the hot path: one per rollout
        _validate_experience(msg)
        return
    for name in _FLOAT_FIELDS[type(msg)]:
        if not math.isfinite(getattr(msg, name)):
            raise NonFinite(name, f"is {getattr(msg, name)!r}, a finite number is required")
    if rates := getattr(msg, "topic_rates", None):
        for topic, rate in rates.items():
            if not math.isfinite(rate):
                raise NonFinite(f"topic_rates[{topic!r}]", f"is {rate!r}, a finite number is required")


def check_schema(schema: int) -> None:
    """Raises ``SchemaTooNew`` / ``SchemaMismatch`` unless this reader understands ``schema``."""
    if schema > SCHEMA_VERSION:
        raise SchemaTooNew("schema", f"version {schema} is newer than this reader's {SCHEMA_VERSION}; upgrade the reader")
    if schema < 1:
        raise SchemaMismatch("schema", f"version {schema} is not a protocol version (1..{SCHEMA_VERSION})")


def _validate_experience(msg: Experience) -> None:
    _validate_experience_scalars(msg)
    logprobs = np.frombuffer(msg.behaviour_logprobs, dtype=FLOAT_DTYPE)
    # One reduction instead of isfinite().all(): NaN and inf propagate through a sum, and a
    # float64 sum of float32 values cannot overflow.
    if not math.isfinite(np.add.reduce(logprobs, dtype=np.float64)):
        i = int(np.flatnonzero(~np.isfinite(logprobs))[0])
        raise NonFinite(f"behaviour_logprobs[{i}]", f"is {float(logprobs[i])!r}, a finite log-prob is required")


def _all_valid(msgs: list) -> bool:
    """``validate`` for a whole frame at once: the log-prob check is one numpy call per frame.
    False means some message is bad: check them one by one to say which and why."""
    logprobs = []
    try:
        for msg in msgs:
            if type(msg) is Experience and msg.schema == SCHEMA_VERSION:
                _validate_experience_scalars(msg)
                logprobs.append(msg.behaviour_logprobs)
            else:
                validate(msg)
    except DecodeError:
        return False
    joined = np.frombuffer(b"".join(logprobs), dtype=FLOAT_DTYPE)
    return math.isfinite(np.add.reduce(joined, dtype=np.float64))


def _validate_experience_scalars(msg: Experience) -> None:
    if not (math.isfinite(msg.reward) and math.isfinite(msg.created_at) and math.isfinite(msg.generated_at)):
        name = next(n for n in ("reward", "created_at", "generated_at") if not math.isfinite(getattr(msg, n)))
        raise NonFinite(name, f"is {getattr(msg, name)!r}, a finite number is required")
    n_prompt, n_ids, n_lp = len(msg.prompt_ids), len(msg.completion_ids), len(msg.behaviour_logprobs)
    if n_prompt % 4 or n_ids % 4 or n_lp % 4:
        name = next(n for n in ("prompt_ids", "completion_ids", "behaviour_logprobs") if len(getattr(msg, n)) % 4)
        raise BadArray(name, f"has {len(getattr(msg, name))} bytes, not a multiple of 4 (int32/float32 LE)")
    if n_ids != n_lp:
        raise BadArray("behaviour_logprobs", f"has {n_lp // 4} entries but completion_ids has {n_ids // 4}; they must match")
    if not 0 <= msg.sample_index < msg.group_size:
        raise InvalidValue("sample_index", f"is {msg.sample_index}, outside 0..group_size-1 ({msg.group_size})")
    if msg.weight_version < 0:
        raise InvalidValue("weight_version", f"is {msg.weight_version}, must be >= 0")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


class Encoder:
    """Encodes messages (validated: the sender learns of its own bad data first) and frames."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, check: bool = True) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self.max_frame_bytes = max_frame_bytes
        self.check = check

    def encode(self, msg: Any) -> bytes:
        """One message -> bytes; raises ``DecodeError`` subclasses for what a receiver would reject."""
        if self.check:
            validate(msg)
        data = self._enc.encode(msg)
        if len(data) > self.max_frame_bytes:
            raise TooLarge(type(msg).__name__, f"encodes to {len(data)} bytes, over the cap of {self.max_frame_bytes}")
        return data

    @staticmethod
    def frame(items: list) -> bytes:
        """Encoded messages (bytes or buffers) -> one frame: a msgpack array holding them as-is."""
        return b"".join((_array_header(len(items)), *items))


class Frame:
    """A decoded frame: the good messages, their raw bytes (``raws``, decoded on first use), and one
    error per rejected part. ``whole`` is the frame's bytes when every part was good, else None."""

    __slots__ = ("messages", "errors", "whole", "_raws")
    _raw_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])

    def __init__(self, messages: list | None = None, raws: list | None = None, whole=None) -> None:
        self.messages = messages if messages is not None else []
        self.errors: list[DecodeError] = []
        self.whole = whole
        self._raws = raws if raws is not None else ([] if whole is None else None)

    @property
    def raws(self) -> list:
        """msgspec.Raw per message, same order (a slice of the frame, no copy)."""
        if self._raws is None:
            self._raws = self._raw_decoder.decode(self.whole)
        return self._raws


class Decoder:
    """Typed decoder for one socket. ``types`` defaults to every application message type."""

    def __init__(self, types: tuple[type, ...] = MESSAGE_TYPES, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.types = types
        self._dec = msgspec.msgpack.Decoder(Union[types] if len(types) > 1 else types[0])  # type: ignore[valid-type]
        self._frame_dec = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._list_dec = msgspec.msgpack.Decoder(list[Union[types]] if len(types) > 1 else list[types[0]])  # type: ignore[valid-type]
        self.max_frame_bytes = max_frame_bytes

    def decode(self, data) -> Any:
        """One message -> a typed, validated message; raises a ``DecodeError`` subclass."""
        if len(data) > self.max_frame_bytes:
            raise TooLarge("message", f"is {len(data)} bytes, over the cap of {self.max_frame_bytes}")
        try:
            msg = self._dec.decode(data)
        except msgspec.ValidationError as exc:
            raise self._explain(data, str(exc)) from None
        except msgspec.DecodeError as exc:
            raise _decode_failure("message", str(exc)) from None
        validate(msg)
        return msg

    def decode_frame(self, data) -> Frame:
        """One frame -> ``Frame``; a bad frame yields one error, a bad item one error each.

        Fast path: the whole frame in one typed msgspec call, then one validation pass;
        anything wrong falls back to item by item, which is what names the errors."""
        if len(data) <= self.max_frame_bytes:
            try:
                messages = self._list_dec.decode(data)
            except msgspec.DecodeError:  # (ValidationError too)
                pass
            else:
                if messages and _all_valid(messages):
                    return Frame(messages, whole=data)
        return self._decode_items(data)

    def _decode_items(self, data) -> Frame:
        out = Frame()
        if len(data) > self.max_frame_bytes:
            out.errors.append(TooLarge("frame", f"is {len(data)} bytes, over the cap of {self.max_frame_bytes}"))
            return out
        try:
            raws = self._frame_dec.decode(data)
        except msgspec.ValidationError:
            out.errors.append(Malformed("frame", "is not an array of messages"))
            return out
        except msgspec.DecodeError as exc:
            out.errors.append(_decode_failure("frame", str(exc)))
            return out
        if not raws:
            out.errors.append(Malformed("frame", "is an empty array; a frame carries at least one message"))
        for raw in raws:
            try:
                msg = self.decode(raw)
            except DecodeError as exc:
                out.errors.append(exc)
                continue
            out.messages.append(msg)
            out.raws.append(raw)
        if not out.errors:
            out.whole = data
        return out

    def _explain(self, data, text: str) -> DecodeError:
        """Turns msgspec's ``$[k]`` paths into field names, and spots too-new schemas."""
        try:
            generic = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            generic = None
        if isinstance(generic, list) and generic and isinstance(generic[0], str):
            t = _TAG_TO_TYPE.get(generic[0])
            if len(generic) > 1 and isinstance(generic[1], int) and generic[1] > SCHEMA_VERSION:
                return SchemaTooNew("schema", f"version {generic[1]} is newer than this reader's {SCHEMA_VERSION}; upgrade the reader")
            if t is not None and t not in self.types:
                return SchemaMismatch("type", f"{t.__name__} is not accepted on this socket")
            if t is not None:
                names = ["type", *(f.name for f in msgspec.structs.fields(t))]
                found = _PATH_INDEX.search(text)
                where = f"{t.__name__}.{_field_at(names, int(found.group(1)))}" if found else t.__name__
                return SchemaMismatch(where, text.split(" - at ")[0])
            return SchemaMismatch("type", f"unknown message tag {generic[0][:40]!r}")
        return SchemaMismatch("message", text)


def _field_at(names: list[str], index: int) -> str:
    return names[index] if index < len(names) else f"[{index}]"


def _decode_failure(where: str, text: str) -> DecodeError:
    if "truncated" in text:
        return Truncated(where, "ends in the middle of a value (truncated)")
    return Malformed(where, f"is not valid msgpack ({text})")

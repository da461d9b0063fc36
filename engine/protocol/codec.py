"""Compact, strict msgpack codec for protocol messages. Never pickle.

Wire form of one message (one msgpack map):

    {"v": PROTOCOL_VERSION, "k": KIND, "b": {field: value, ...}}

Nested messages are plain maps (no envelope): the receiver knows their class
from the field annotation, so the kind would be redundant. Tuples travel as
msgpack arrays, bytes as msgpack bin. Messages are msgspec Structs
(engine.protocol.base.Message); msgspec encodes them and decodes them against
their field types, so any module can register its own (pipeline, fleet)
without touching this file.

Decoding is strict: every failure -- bad msgpack, wrong envelope, unknown kind,
wrong version, missing or extra fields, wrong types, failed validation, over a
size limit -- is a ProtocolError with a one-line reason and a code, never any
other exception, so a peer can answer with an ErrorReply and carry on.
A class's own rules run in its __post_init__ (when built, and when decoded) and,
for a class that defines it, in validate() (when encoded and when decoded only).
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from engine.protocol import errors as _errors
from engine.protocol import messages as _messages
from engine.protocol import structured as _structured
from engine.protocol.errors import ProtocolError, one_line
from engine.protocol.version import PROTOCOL_VERSION

MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # one encoded message (tensor frames have their own limit)

_T = TypeVar("_T")
_REGISTRY: dict[str, type] = {}  # KIND -> message class
_PREFIX: dict[type, bytes] = {}  # class -> its envelope's bytes up to the body: {"v": .., "k": .., "b":
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}  # class -> a decoder of its body
# class -> a decoder that checks only that every field is there, nested ones too (msgspec would
# fill a missing field with its default; the wire carries all of them), when the class has defaults
_PRESENCE: dict[type, msgspec.msgpack.Decoder] = {}
_VALIDATED: set[type] = set()  # classes with a validate() the codec runs
_ENCODER = msgspec.msgpack.Encoder()
# Field types with a wire form: scalars, closed sets, tuples, unions of them and nested messages.
# Nothing mutable (list, dict, set), nothing untyped (Any), no msgpack extension.
_WIRE_TYPES = (mi.NoneType, mi.BoolType, mi.IntType, mi.FloatType, mi.StrType, mi.BytesType, mi.LiteralType,
               mi.TupleType, mi.VarTupleType, mi.UnionType, mi.StructType)


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    v: int  # PROTOCOL_VERSION
    k: str  # KIND
    b: msgspec.Raw  # the body's bytes, decoded once the kind is known


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


# ---------------------------------------------------------------- registry


def register(cls: type[_T]) -> type[_T]:
    """Class decorator: make a frozen msgspec Struct that forbids unknown fields, with a str
    ClassVar KIND, encodable and decodable at top level. Raises TypeError for a class the
    codec cannot handle, at import time rather than on the first message."""
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        raise TypeError(f"{cls!r} is not a msgspec Struct")
    kind = cls.__dict__.get("KIND")
    if not (isinstance(kind, str) and kind):
        raise TypeError(f"{cls.__name__} needs its own non-empty str ClassVar KIND")
    known = _REGISTRY.get(kind)
    if known is not None and known is not cls:
        raise TypeError(f"kind {kind!r} is already registered by {known.__qualname__}")
    try:
        info = mi.type_info(cls)
        decoder = msgspec.msgpack.Decoder(cls)
    except Exception as e:  # an annotation that does not resolve, a union msgspec cannot decode
        raise TypeError(f"{cls.__name__}: {type(e).__name__}: {e}") from None
    _check_struct(info, set())
    defaults: list[str] = []
    presence = _presence_struct(info, {}, defaults)
    _REGISTRY[kind] = cls
    _PREFIX[cls] = _ENCODER.encode({"v": PROTOCOL_VERSION, "k": kind, "b": None})[:-1]  # less the nil
    _DECODERS[cls] = decoder
    if defaults:
        _PRESENCE[cls] = msgspec.msgpack.Decoder(presence)
    if callable(getattr(cls, "validate", None)):
        _VALIDATED.add(cls)
    return cls


def registered() -> Mapping[str, type]:
    """A read-only view of KIND -> class."""
    return types.MappingProxyType(_REGISTRY)


def _check_struct(info: mi.StructType, seen: set[type]) -> None:
    """Reject a message class (or one nested in it) whose wire form would not be strict."""
    cls = info.cls
    if cls in seen:
        return
    seen.add(cls)
    cfg = cls.__struct_config__
    if not (cfg.frozen and cfg.forbid_unknown_fields):
        raise TypeError(f"{cls.__name__} must be a frozen Struct with forbid_unknown_fields "
                        "(subclass engine.protocol.base.Message)")
    renamed = cls.__struct_encode_fields__ != cls.__struct_fields__
    if cfg.array_like or cfg.omit_defaults or cfg.tag is not None or renamed:
        raise TypeError(f"{cls.__name__}: a message travels as a map of all its fields, by their names")
    for f in info.fields:
        _check_type(f.type, f"{cls.__name__}.{f.name}", seen)


def _check_type(tp: mi.Type, where: str, seen: set[type]) -> None:
    if not isinstance(tp, _WIRE_TYPES):
        raise TypeError(f"{where}: no wire form for {type(tp).__name__}")
    if isinstance(tp, mi.StructType):
        _check_struct(tp, seen)
    elif isinstance(tp, mi.UnionType):
        for arm in tp.types:
            _check_type(arm, where, seen)
    elif isinstance(tp, mi.TupleType):
        for arm in tp.item_types:
            _check_type(arm, where, seen)
    elif isinstance(tp, mi.VarTupleType):
        _check_type(tp.item_type, where, seen)


def _presence_struct(info: mi.StructType, made: dict[type, type | None], defaults: list[str]) -> type:
    """A Struct with the fields of info.cls, all required, that skips their values (msgspec.Raw)
    but for nested messages, which get their own such Struct. Appends to defaults the fields
    that have one (without any, msgspec itself refuses a missing field)."""
    cls = info.cls
    if cls in made:
        done = made[cls]
        if done is None:
            raise TypeError(f"{cls.__name__} holds itself: a message is a tree")
        return done
    made[cls] = None
    fields = []
    for f in info.fields:
        where = f"{cls.__name__}.{f.name}"
        fields.append((f.name, _presence_type(f.type, made, defaults, where)))
        if not f.required:
            defaults.append(where)
    made[cls] = done = msgspec.defstruct(f"{cls.__name__}Fields", fields, forbid_unknown_fields=True)
    return done


def _presence_type(tp: mi.Type, made: dict[type, type | None], defaults: list[str], where: str) -> Any:
    if not _holds_struct(tp):
        return msgspec.Raw
    if isinstance(tp, mi.StructType):
        return _presence_struct(tp, made, defaults)
    if isinstance(tp, mi.VarTupleType):
        return tuple[_presence_type(tp.item_type, made, defaults, where), ...]  # type: ignore[misc]
    if isinstance(tp, mi.UnionType) and len(tp.types) == 2 and any(isinstance(a, mi.NoneType) for a in tp.types):
        (arm,) = [a for a in tp.types if not isinstance(a, mi.NoneType)]
        return _presence_type(arm, made, defaults, where) | None
    raise TypeError(f"{where}: a nested message may be X, X | None or tuple[X, ...] only")


def _holds_struct(tp: mi.Type) -> bool:
    if isinstance(tp, mi.StructType):
        return True
    if isinstance(tp, mi.UnionType):
        return any(_holds_struct(a) for a in tp.types)
    if isinstance(tp, mi.TupleType):
        return any(_holds_struct(a) for a in tp.item_types)
    if isinstance(tp, mi.VarTupleType):
        return _holds_struct(tp.item_type)
    return False


# ---------------------------------------------------------------- encode


def encode(msg: Any, *, max_bytes: int | None = None) -> bytes:
    """The wire bytes of a registered message. Raises ProtocolError for an
    unregistered object, an unencodable value, a message whose validate() fails,
    or a result over max_bytes (default MAX_MESSAGE_BYTES) that the peer would
    refuse anyway."""
    cls = type(msg)
    prefix = _PREFIX.get(cls)
    if prefix is None:
        raise ProtocolError(f"{cls.__name__} is not a registered message", "unknown_kind")
    kind = cls.KIND  # type: ignore[attr-defined]
    if cls in _VALIDATED:
        try:
            msg.validate()
        except ProtocolError as e:
            raise ProtocolError(f"{kind}: {e}", e.code, e.refusal) from None
    try:
        data = prefix + _ENCODER.encode(msg)
    except Exception as e:  # e.g. an int over 64 bits, a lone surrogate in a str, a numpy scalar
        raise ProtocolError(f"cannot encode {kind}: {type(e).__name__}: {e}") from None
    limit = MAX_MESSAGE_BYTES if max_bytes is None else max_bytes
    if len(data) > limit:
        raise ProtocolError(f"{kind} is {len(data)} bytes, over the {limit}-byte limit", "too_large")
    return data


# ---------------------------------------------------------------- decode


def decode(data: bytes, *, max_bytes: int | None = None) -> Any:
    """The message in data, validated. Raises ProtocolError (and only that)
    for anything but one complete, valid, registered message of this version."""
    try:
        n = memoryview(data).nbytes
    except TypeError:
        raise ProtocolError(f"expected bytes, got {type(data).__name__}") from None
    limit = MAX_MESSAGE_BYTES if max_bytes is None else max_bytes
    if n > limit:
        raise ProtocolError(f"message is {n} bytes, over the {limit}-byte limit", "too_large")
    if n == 0:
        raise ProtocolError("empty message")
    try:
        env = _ENVELOPE.decode(data)
    except msgspec.ValidationError as e:
        err = str(wire_error("envelope", e))  # e.g. "envelope.v: expected int, got str"
        if err.startswith("envelope.v: "):  # a version that is not even a number
            raise ProtocolError(err.replace("envelope.v: expected int,", "protocol version must be an integer,"),
                                "version") from None
        raise ProtocolError(err.replace("envelope.k: expected str,", "kind must be a string,")) from None
    except Exception as e:  # DecodeError (truncated, trailing bytes, bad UTF-8), BufferError, RecursionError
        raise _not_msgpack(e) from None
    v, k = env.v, env.k
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v} is not supported; this peer speaks "
                            f"version {PROTOCOL_VERSION}", "version")
    cls = _REGISTRY.get(k)
    if cls is None:
        raise ProtocolError(f"unknown message kind {k!r:.60}", "unknown_kind")
    try:
        presence = _PRESENCE.get(cls)
        if presence is not None:
            presence.decode(env.b)
        msg = _DECODERS[cls].decode(env.b)
        if cls in _VALIDATED:
            msg.validate()
    except ProtocolError as e:  # from validate()
        raise ProtocolError(f"{k}: {e}", e.code, e.refusal) from None
    except msgspec.ValidationError as e:  # a wrong type, a missing or extra field, a rule of __post_init__
        raise wire_error(k, e) from None
    except msgspec.DecodeError as e:
        raise _not_msgpack(e) from None
    except Exception as e:  # a rule that raised something else is still bad input
        raise ProtocolError(f"{k}: invalid ({type(e).__name__}: {one_line(e, 80)})") from None
    return msg


# ---------------------------------------------------------------- reasons

# msgspec's reasons end with where the fault is: "Expected `int`, got `str` - at `$.sampling.seed`"
_AT = re.compile(r"(.*) - at `\$(.*)`\Z", re.DOTALL)


def wire_error(what: str, e: msgspec.ValidationError) -> ProtocolError:
    """A ProtocolError for msgspec's verdict on a message's fields, named `what.path: reason`.
    A rule of a class (its __post_init__ raised a ProtocolError) keeps its code and refusal."""
    text, path = str(e), ""
    m = _AT.match(text)
    if m is not None:
        text, path = m.group(1), m.group(2)
    cause = e.__cause__
    if isinstance(cause, ProtocolError):
        return ProtocolError(f"{what}{path}: {cause}", cause.code, cause.refusal)
    text = text.replace("`", "")
    return ProtocolError(f"{what}{path}: {text[:1].lower()}{text[1:]}")


def _not_msgpack(e: Exception) -> ProtocolError:
    if "trailing characters" in str(e):
        return ProtocolError("trailing bytes after the message")
    return ProtocolError(f"not valid msgpack ({type(e).__name__}: {one_line(e, 80)})")


# ---------------------------------------------------------------- built-ins

for _cls in (_messages.ChatMessage, _messages.SamplingParams, _messages.GenerateRequest,
             _messages.Usage, _messages.Timings, _messages.TokenLogprob, _messages.TokenEvent, _messages.ErrorReply,
             _errors.Refusal, _structured.ToolSpec, _structured.ToolCall):
    register(_cls)
del _cls


def __getattr__(name: str) -> Any:
    # The tensor-frame half lives in frames.py (it registers its own header
    # messages here, so it must import this module, not the other way round).
    if name in ("encode_frames", "decode_frames", "TensorSpec", "FramedHeader",
                "MAX_TENSOR_BYTES"):
        from engine.protocol import frames

        return getattr(frames, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

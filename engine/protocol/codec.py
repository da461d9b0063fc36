"""Compact, strict msgpack codec for protocol messages. Never pickle.

Wire form of one message (one msgpack map):

    {"v": PROTOCOL_VERSION, "k": KIND, "b": {field: value, ...}}

Nested messages are plain maps (no envelope): the receiver knows their class
from the field annotation, so the kind would be redundant. Tuples travel as
msgpack arrays, bytes as msgpack bin. The converter is generic, driven by
typing.get_type_hints, so any module can register its own frozen dataclasses
(pipeline, fleet) without touching this file.

Decoding is strict: every failure -- bad msgpack, wrong envelope, unknown kind,
wrong version, missing or extra fields, wrong types, failed validation, over a
size limit -- is a ProtocolError with a one-line reason and a code, never any
other exception, so a peer can answer with an ErrorReply and carry on.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack

from engine.protocol import messages as _messages
from engine.protocol import structured as _structured
from engine.protocol.errors import ProtocolError, one_line
from engine.protocol.version import PROTOCOL_VERSION

MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # one encoded message (tensor frames have their own limit)
# Caps on any one container a message may hold. The decoder also caps them at
# the input length, so a few bytes claiming a 4-billion-item array fail at once.
MAX_CONTAINER_ITEMS = 1_000_000

_T = TypeVar("_T")
_REGISTRY: dict[str, type] = {}  # KIND -> message class
_HINTS: dict[type, tuple[tuple[str, Any], ...]] = {}  # class -> ((field, annotation), ...)
_NONE = type(None)
_SCALARS = (bool, int, float, str, bytes)


# ---------------------------------------------------------------- registry


def register(cls: type[_T]) -> type[_T]:
    """Class decorator: make a frozen dataclass with a str ClassVar KIND
    encodable and decodable at top level. Raises TypeError for a class the
    converter cannot handle, at import time rather than on the first message."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    kind = cls.__dict__.get("KIND")
    if not (isinstance(kind, str) and kind):
        raise TypeError(f"{cls.__name__} needs its own non-empty str ClassVar KIND")
    known = _REGISTRY.get(kind)
    if known is not None and known is not cls:
        raise TypeError(f"kind {kind!r} is already registered by {known.__qualname__}")
    _fields(cls)  # resolve and check every annotation now
    _REGISTRY[kind] = cls
    return cls


def registered() -> Mapping[str, type]:
    """A read-only view of KIND -> class."""
    return types.MappingProxyType(_REGISTRY)


def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, resolved annotation) of the init fields of a message class, cached."""
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = tuple((f.name, resolved[f.name]) for f in dataclasses.fields(cls) if f.init)
        _HINTS[cls] = hints  # before checking, so a self-referencing class terminates
        try:
            for name, tp in hints:
                _check_type(tp, f"{cls.__name__}.{name}")
        except Exception:
            del _HINTS[cls]
            raise
    return hints


def _check_type(tp: Any, where: str) -> None:
    """Reject annotations the converter has no wire form for (TypeError)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is _NONE or tp in _SCALARS:
        return
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            _check_type(arm, where)
    elif origin is tuple:
        for arm in args:
            if arm is not Ellipsis:
                _check_type(arm, where)
    elif origin is typing.Literal:
        if not all(type(a) in (bool, int, str) for a in args):
            raise TypeError(f"{where}: Literal values must be bool, int or str")
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        _fields(tp)
    else:
        raise TypeError(f"{where}: no wire form for annotation {tp!r}")


# ---------------------------------------------------------------- encode


def _to_wire(value: Any) -> Any:
    """A validated message value as plain msgpack-able data."""
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _to_wire(getattr(value, name)) for name, _ in _fields(type(value))}
    raise ProtocolError(f"cannot encode a {type(value).__name__}")


def encode(msg: Any, *, max_bytes: int | None = None) -> bytes:
    """The wire bytes of a registered message. Raises ProtocolError for an
    unregistered object, an unencodable value, or a result over max_bytes
    (default MAX_MESSAGE_BYTES) that the peer would refuse anyway."""
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, str) or _REGISTRY.get(kind) is not cls:
        raise ProtocolError(f"{cls.__name__} is not a registered message", "unknown_kind")
    try:
        body = _to_wire(msg)
        data = msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "b": body},
                             use_bin_type=True, use_single_float=False)
    except ProtocolError:
        raise
    except Exception as e:  # e.g. an int over 64 bits, a lone surrogate in a str
        raise ProtocolError(f"cannot encode {kind}: {type(e).__name__}: {e}") from None
    limit = MAX_MESSAGE_BYTES if max_bytes is None else max_bytes
    if len(data) > limit:
        raise ProtocolError(f"{kind} is {len(data)} bytes, over the {limit}-byte limit", "too_large")
    return data


# ---------------------------------------------------------------- decode


def _unpack(data: Any, max_bytes: int | None) -> Any:
    """msgpack bytes -> plain objects, with every limit checked up front."""
    try:
        n = memoryview(data).nbytes
    except TypeError:
        raise ProtocolError(f"expected bytes, got {type(data).__name__}") from None
    limit = MAX_MESSAGE_BYTES if max_bytes is None else max_bytes
    if n > limit:
        raise ProtocolError(f"message is {n} bytes, over the {limit}-byte limit", "too_large")
    if n == 0:
        raise ProtocolError("empty message")
    items = min(n, MAX_CONTAINER_ITEMS)  # an item takes at least one byte
    try:
        return msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, timestamp=0,
            max_str_len=n, max_bin_len=n, max_ext_len=0,
            max_array_len=items, max_map_len=items // 2 + 1,
        )
    except msgpack.ExtraData:
        raise ProtocolError("trailing bytes after the message") from None
    except Exception as e:  # OutOfData, FormatError, StackError, ValueError, UnicodeDecodeError
        if "max_ext_len" in str(e):  # we use no msgpack extension types at all
            raise ProtocolError("msgpack extension types are not allowed") from None
        code = "too_large" if "exceeds max_" in str(e) else "malformed"
        raise ProtocolError(f"not valid msgpack ({type(e).__name__}: {one_line(e, 80)})",
                            code) from None


def decode(data: bytes, *, max_bytes: int | None = None) -> Any:
    """The message in data, validated. Raises ProtocolError (and only that)
    for anything but one complete, valid, registered message of this version."""
    obj = _unpack(data, max_bytes)
    if not isinstance(obj, dict):
        raise ProtocolError(f"envelope must be a map, got {_wire_name(obj)}")
    if set(obj) != {"v", "k", "b"}:
        raise ProtocolError(f"envelope must have exactly the keys v, k, b; got {_keys(obj)}")
    v, k = obj["v"], obj["k"]
    if not (isinstance(v, int) and not isinstance(v, bool)):
        raise ProtocolError(f"protocol version must be an integer, got {_wire_name(v)}", "version")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v} is not supported; this peer speaks "
                            f"version {PROTOCOL_VERSION}", "version")
    if not isinstance(k, str):
        raise ProtocolError(f"kind must be a string, got {_wire_name(k)}")
    cls = _REGISTRY.get(k)
    if cls is None:
        raise ProtocolError(f"unknown message kind {k!r:.60}", "unknown_kind")
    try:
        return _build(cls, obj["b"], k)
    except RecursionError:  # only reachable through a self-referencing message class
        raise ProtocolError(f"{k}: nested too deeply") from None


def _build(cls: type, body: Any, path: str) -> Any:
    """A message of cls from its wire map; path names it in error reasons."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{path}: expected a map, got {_wire_name(body)}")
    hints = _fields(cls)
    names = {name for name, _ in hints}
    extra = [key for key in body if key not in names]
    if extra:
        raise ProtocolError(f"{path}: unexpected field(s) {_keys(extra)}")
    missing = [name for name in names if name not in body]
    if missing:
        raise ProtocolError(f"{path}: missing field(s) {', '.join(sorted(missing))}")
    kwargs = {name: _from_wire(body[name], tp, f"{path}.{name}") for name, tp in hints}
    try:
        return cls(**kwargs)
    except ProtocolError as e:
        raise ProtocolError(f"{path}: {e}", e.code, e.refusal) from None
    except Exception as e:  # a validator that raised something else is still bad input
        raise ProtocolError(f"{path}: invalid ({type(e).__name__}: {e})") from None


def _from_wire(obj: Any, tp: Any, path: str) -> Any:
    """Plain wire data -> a value of annotation tp, strictly."""
    if tp is _NONE:
        if obj is None:
            return None
    elif tp is bool:
        if isinstance(obj, bool):
            return obj
    elif tp is int:
        if isinstance(obj, int) and not isinstance(obj, bool):
            return obj
    elif tp is float:  # ints are fine where floats are expected; bools are not
        if isinstance(obj, float):
            return obj
        if isinstance(obj, int) and not isinstance(obj, bool):
            return float(obj)  # msgpack ints are < 2**64, so this cannot overflow
    elif tp is str:
        if isinstance(obj, str):
            return obj
    elif tp is bytes:
        if isinstance(obj, bytes):
            return obj
    else:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return _from_union(obj, args, path)
        if origin is tuple:
            return _from_tuple(obj, args, path)
        if origin is typing.Literal:
            for a in args:  # type() match keeps True from passing as 1
                if type(obj) is type(a) and obj == a:
                    return obj
            raise ProtocolError(f"{path}: must be one of {args}")
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return _build(tp, obj, path)
    raise ProtocolError(f"{path}: expected {_type_name(tp)}, got {_wire_name(obj)}")


def _from_union(obj: Any, arms: tuple[Any, ...], path: str) -> Any:
    if obj is None:
        if _NONE in arms:
            return None
    first: ProtocolError | None = None
    for arm in arms:  # first arm that takes the value wins, so order int before float
        if arm is _NONE:
            continue
        try:
            return _from_wire(obj, arm, path)
        except ProtocolError as e:
            first = first or e
    if first is not None and sum(a is not _NONE for a in arms) == 1:
        raise first  # X | None: the reason for X is the useful one
    raise ProtocolError(f"{path}: expected {_type_name(arms)}, got {_wire_name(obj)}")


def _from_tuple(obj: Any, args: tuple[Any, ...], path: str) -> tuple[Any, ...]:
    if not isinstance(obj, list):
        raise ProtocolError(f"{path}: expected an array, got {_wire_name(obj)}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_from_wire(x, args[0], f"{path}[{i}]") for i, x in enumerate(obj))
    if args == ((),) or not args:  # tuple[()] : the empty tuple
        args = ()
    if len(obj) != len(args):
        raise ProtocolError(f"{path}: expected {len(args)} items, got {len(obj)}")
    return tuple(_from_wire(x, a, f"{path}[{i}]") for i, (x, a) in enumerate(zip(obj, args)))


# ---------------------------------------------------------------- reasons


def _wire_name(obj: Any) -> str:
    """The msgpack-level name of a decoded value, for reasons."""
    names = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin",
             list: "array", dict: "map", _NONE: "nil"}
    return names.get(type(obj), type(obj).__name__)


def _type_name(tp: Any) -> str:
    if isinstance(tp, tuple):
        return " | ".join(_type_name(a) for a in tp)
    if tp is _NONE:
        return "nil"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} map"
    return getattr(tp, "__name__", None) or str(tp)


def _keys(keys: Any) -> str:
    """A short rendering of (possibly hostile) map keys."""
    ks = list(keys)
    shown = ", ".join(one_line(repr(k), 40) for k in ks[:5])
    return shown + (f" and {len(ks) - 5} more" if len(ks) > 5 else "")


# ---------------------------------------------------------------- built-ins

for _cls in (_messages.ChatMessage, _messages.SamplingParams, _messages.GenerateRequest,
             _messages.Usage, _messages.Timings, _messages.TokenLogprob, _messages.TokenEvent, _messages.ErrorReply,
             _messages.Refusal, _structured.ToolSpec, _structured.ToolCall):
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

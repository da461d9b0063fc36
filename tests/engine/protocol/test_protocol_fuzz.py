"""Fuzz: whatever bytes arrive, decode returns a valid message or raises
ProtocolError -- never another exception, never a hang."""

from __future__ import annotations

import time

import msgspec
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from protocol_strategies import FUZZ, all_messages, pack, wire_objects

from engine.protocol import (
    PROTOCOL_VERSION,
    GenerateRequest,
    ProtocolError,
    decode,
    decode_frames,
    encode,
    encode_frames,
    registered,
)


def _decode_or_reject(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert registered()[msg.KIND] is type(msg)
    assert decode(encode(msg)) == msg  # anything accepted is a real, stable message


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode_or_reject(data)


@FUZZ
@given(wire_objects)
def test_random_msgpack_objects(obj: object) -> None:
    _decode_or_reject(pack(obj))


@st.composite
def envelopes(draw: st.DrawFn) -> dict:
    """Right envelope, right kind, right field names, random values: this
    reaches deep into the type converter and the validators."""
    kind = draw(st.sampled_from(sorted(registered())))
    names = [f.encode_name for f in msgspec.structs.fields(registered()[kind])]
    body = {name: draw(wire_objects) for name in names if draw(st.integers(0, 9))}
    return {"v": draw(st.just(PROTOCOL_VERSION) | st.integers(-2, PROTOCOL_VERSION + 1)), "k": kind, "b": body}


@FUZZ
@given(envelopes())
def test_random_bodies(env: dict) -> None:
    _decode_or_reject(pack(env))


@st.composite
def mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(encode(draw(all_messages)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "append", "insert", "delete"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[i:]
        elif op == "append":
            data += draw(st.binary(min_size=1, max_size=8))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[i]
    return bytes(data)


@FUZZ
@given(mutations())
def test_mutated_valid_encodings(data: bytes) -> None:
    _decode_or_reject(data)


def test_small_input_claiming_huge_containers_is_rejected_fast() -> None:
    claims = [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 G items
        b"\xdf\xff\xff\xff\xff",  # map32 of 4 G pairs
        b"\xdb\xff\xff\xff\xff",  # str32 of 4 GB
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GB
        b"\xc9\xff\xff\xff\xff\x01",  # ext32 of 4 GB
        b"\x83\xa1v\x01\xa1k\xa5usage\xa1b\xdf\xff\xff\xff\xff",  # nested claim
        b"\x91" * 100_000 + b"\xc0",  # deep nesting
    ]
    for data in claims:
        start = time.perf_counter()
        try:
            decode(data)
        except ProtocolError:
            pass
        else:
            raise AssertionError(f"accepted {data[:16]!r}")
        assert time.perf_counter() - start < 0.5


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames(frames: list[bytes]) -> None:
    try:
        decode_frames(frames)
    except ProtocolError:
        pass


@FUZZ
@given(st.data())
def test_mutated_frames(data: st.DataObject) -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.bool_)]
    frames = [bytearray(f) for f in encode_frames(GenerateRequest("r", prompt="p"), arrays)]
    k = data.draw(st.integers(0, len(frames) - 1))
    if frames[k]:
        i = data.draw(st.integers(0, len(frames[k]) - 1))
        frames[k][i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        frames[k] = frames[k][: data.draw(st.integers(0, len(frames[k])))]
    try:
        msg, out = decode_frames([bytes(f) for f in frames])
    except ProtocolError:
        return
    assert isinstance(msg, GenerateRequest) and len(out) == 2

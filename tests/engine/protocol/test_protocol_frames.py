"""Tensor frames: bit-exact round trips and every header/frame mismatch."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from protocol_strategies import FAST, pack, plain_messages, wire

from engine.protocol import (
    DTYPES,
    MAX_TENSOR_BYTES,
    FramedHeader,
    GenerateRequest,
    ProtocolError,
    TensorSpec,
    Usage,
    decode,
    decode_frames,
    encode,
    encode_frames,
)

MSG = GenerateRequest("r", prompt="x")
NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
               "int64": np.int64, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}


def _random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random BITS, so NaN payloads, -0.0 and subnormals are all covered."""
    n = math.prod(shape)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    itemsize = DTYPES[dtype].itemsize
    raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    return raw.view(NUMPY_DTYPE[dtype]).reshape(shape)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@FAST
@given(dtypes=st.lists(st.sampled_from(sorted(DTYPES)), max_size=4),
       shapes=st.lists(st.lists(st.integers(0, 5), max_size=4), min_size=4, max_size=4),
       seed=st.integers(0, 2**32 - 1), msg=plain_messages)
def test_tensor_round_trip_is_bit_exact(dtypes, shapes, seed, msg) -> None:
    rng = np.random.default_rng(seed)
    arrays = [_random_array(rng, d, tuple(s)) for d, s in zip(dtypes, shapes)]
    frames = encode_frames(msg, arrays)
    assert len(frames) == len(arrays) + 1
    back, out = decode_frames([bytes(f) for f in frames])
    assert back == msg
    for a, b in zip(arrays, out, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and _bits(b) == _bits(a)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3), (1, 1, 7)])
def test_each_dtype_and_zero_size_dims(dtype: str, shape: tuple[int, ...]) -> None:
    a = _random_array(np.random.default_rng(0), dtype, shape)
    frames = encode_frames(MSG, [a])
    assert decode(frames[0]).tensors == (TensorSpec(dtype, shape, a.nbytes),)
    _, (b,) = decode_frames(frames)
    assert b.dtype == a.dtype and b.shape == shape and _bits(b) == _bits(a)


def test_bfloat16_travels_as_uint16_bits() -> None:
    bits = np.array([0x3F80, 0xFFC1, 0x8000, 0x7F80], dtype=np.uint16)  # 1, NaN, -0, inf
    frames = encode_frames(MSG, [bits])
    assert decode(frames[0]).tensors[0].dtype == "bfloat16"
    _, (out,) = decode_frames(frames)
    assert out.dtype == np.uint16 and np.array_equal(out, bits)


def test_contiguous_arrays_are_sent_without_copy() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = encode_frames(MSG, [a])
    assert isinstance(frames[1], memoryview) and np.shares_memory(np.asarray(frames[1]), a)
    _, (out,) = decode_frames(frames)
    assert np.shares_memory(out, a)  # frombuffer views the frame, too


def test_strided_and_big_endian_inputs_are_normalised() -> None:
    base = np.arange(24, dtype=np.int64).reshape(4, 6)
    strided = base[:, ::2].T
    big = np.arange(5, dtype=">f4")
    _, (a, b) = decode_frames(encode_frames(MSG, [strided, big]))
    assert np.array_equal(a, strided) and a.flags.c_contiguous
    assert np.array_equal(b, big) and b.dtype == np.dtype("<f4")


def test_frames_accept_any_buffer() -> None:
    a = np.arange(6, dtype=np.int32)
    frames = encode_frames(MSG, [a])
    for conv in (bytes, bytearray, memoryview):
        _, (out,) = decode_frames([conv(f) for f in frames])
        assert np.array_equal(out, a)
    _, (out,) = decode_frames(tuple(frames))
    assert np.array_equal(out, a)


def test_no_tensors() -> None:
    frames = encode_frames(MSG, [])
    assert len(frames) == 1 and decode_frames(frames) == (MSG, [])


# ---------------------------------------------------------------- rejections


@pytest.mark.parametrize("bad", [
    np.zeros(3, np.float64), np.zeros(3, np.complex64), np.zeros(3, np.int16),
    np.zeros(3, np.uint32), np.array(["a"]), np.array([object()]),
])
def test_disallowed_dtypes_are_not_encoded(bad: np.ndarray) -> None:
    with pytest.raises(ProtocolError, match="dtype"):
        encode_frames(MSG, [bad])


def test_encode_rejects_non_arrays_and_headers() -> None:
    for tensors in ([[1.0, 2.0]], np.zeros(3, np.float32), [None]):
        with pytest.raises(ProtocolError):
            encode_frames(MSG, tensors)
    header = FramedHeader(encode(MSG), ())
    with pytest.raises(ProtocolError):
        encode_frames(header, [])
    with pytest.raises(ProtocolError) as info:
        encode_frames(MSG, [np.zeros(100, np.uint8)], max_tensor_bytes=99)
    assert info.value.code == "too_large"


def _frames() -> list[bytes]:
    return [bytes(f) for f in encode_frames(MSG, [np.arange(4, dtype=np.float32),
                                                  np.ones((2, 2), np.bool_)])]


def _with_header(tensors: list[dict], payload: bytes | None = None) -> bytes:
    env = wire(FramedHeader(encode(MSG), ()))
    env["b"]["tensors"] = tensors
    if payload is not None:
        env["b"]["payload"] = payload
    return pack(env)


@pytest.mark.parametrize("frames, code", [
    (lambda f: f[:2], "malformed"),  # a tensor frame missing
    (lambda f: f + [b""], "malformed"),  # one too many
    (lambda f: f[:1], "malformed"),
    (lambda f: [], "malformed"),
    (lambda f: [f[0], f[1][:-1], f[2]], "malformed"),  # short frame
    (lambda f: [f[0], f[1] + b"\x00", f[2]], "malformed"),  # long frame
    (lambda f: [f[0], f[1], b"\x02\x00\x01\x00"], "malformed"),  # bool byte 2
    (lambda f: [f[0], 5, f[2]], "malformed"),  # not a buffer
    (lambda f: [f[0], np.zeros((4, 4), np.uint8)[:, 0], f[2]], "malformed"),  # strided
    (lambda f: [f[0][:-1], f[1], f[2]], "malformed"),  # broken header
    (lambda f: [encode(MSG), f[1], f[2]], "malformed"),  # frame 0 not a header
    (lambda f: [encode(FramedHeader(encode(FramedHeader(encode(MSG), ())), ()))], "malformed"),
    (lambda f: [_with_header([{"dtype": "float64", "shape": [1], "nbytes": 8}]), b"\x00" * 8],
     "malformed"),
    (lambda f: [_with_header([{"dtype": "float32", "shape": [2], "nbytes": 4}]), b"\x00" * 4],
     "malformed"),  # nbytes does not match shape
    (lambda f: [_with_header([{"dtype": "float32", "shape": [-1], "nbytes": 4}]), b"\x00" * 4],
     "malformed"),
    (lambda f: [_with_header([{"dtype": "uint8", "shape": [2**40], "nbytes": 2**40}]), b""],
     "malformed"),  # a huge claim fails on the spec, before any allocation
    (lambda f: [_with_header([{"dtype": "uint8", "shape": [2**29], "nbytes": 2**29}] * 3),
                b"", b"", b""], "too_large"),  # each fine, the sum over 1 GiB
    (lambda f: [_with_header([], payload=b"")], "malformed"),
    (lambda f: [_with_header([], payload=b"\x00garbage")], "malformed"),
    (lambda f: "not frames", "malformed"),
    (lambda f: b"bytes", "malformed"),
    (lambda f: [f[0]] + [b""] * 300, "too_large"),
])
def test_bad_frames_are_rejected(frames, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frames(frames(_frames()))
    assert info.value.code == code


def test_tensor_size_limit_on_decode() -> None:
    frames = _frames()
    with pytest.raises(ProtocolError) as info:
        decode_frames(frames, max_tensor_bytes=19)  # 16 + 4 bytes sent
    assert info.value.code == "too_large"
    assert decode_frames(frames, max_tensor_bytes=20)[0] == MSG
    assert MAX_TENSOR_BYTES == 1024**3


def test_header_alone_decodes_and_validates() -> None:
    spec = TensorSpec("int64", (2, 3), 48)
    assert decode(encode(FramedHeader(encode(Usage(1, 2)), (spec,)))).tensors == (spec,)
    for bad in [("int64", (2, 3), 47), ("float64", (1,), 8), ("int32", (1,) * 17, 4)]:
        with pytest.raises(ProtocolError):
            TensorSpec(*bad)
    for shape in ([2, 3.0], [True, 2, 3], "23", [[2, 3]]):  # wrong types: the wire's to refuse
        env = msgpack.unpackb(encode(spec))
        env["b"]["shape"] = shape
        with pytest.raises(ProtocolError):
            decode(pack(env))

"""Tensor frames: a message plus raw activation tensors, for the data plane.

A framed message is a list of ZeroMQ-ready frames:

    frame 0:    encode(FramedHeader(payload=encode(msg), tensors=(TensorSpec, ...)))
    frame 1..N: the raw C-order little-endian bytes of tensor i, nothing else

Tensor bytes never pass through msgpack: they go out as memoryviews of the
caller's arrays (zero-copy when already C-contiguous little-endian) and come
back as np.frombuffer views of the received frames. Every count, dtype, shape
and byte length is checked against the header before any array is made.

bfloat16 has no numpy dtype: it travels as its raw 16 bits. A uint16 array is
sent as "bfloat16" (uint16 has no other use on this wire) and comes back as
uint16; torch users do torch.from_numpy(a).view(torch.bfloat16). An ml_dtypes
bfloat16 array is accepted too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from engine.protocol._checks import require
from engine.protocol.base import Message
from engine.protocol.codec import MAX_MESSAGE_BYTES, decode, encode, register
from engine.protocol.errors import ProtocolError

MAX_TENSOR_BYTES = 1024**3  # all tensors of one framed message together
MAX_TENSORS = 256  # tensors in one framed message
MAX_NDIM = 16  # dimensions of one tensor

# Wire dtype name -> the exact numpy dtype of its bytes (little-endian).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # raw bf16 bits
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}


@register
class TensorSpec(Message):
    """What one raw tensor frame holds."""

    KIND: ClassVar[str] = "tensor_spec"
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]  # C-order dims; 0 is allowed, () is a scalar
    nbytes: int  # = prod(shape) * itemsize; the exact length of the frame

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r:.40}")
        require(len(self.shape) <= MAX_NDIM and all(0 <= d <= MAX_TENSOR_BYTES for d in self.shape),
                f"shape must be at most {MAX_NDIM} non-negative integers")
        require(0 <= self.nbytes <= MAX_TENSOR_BYTES, f"nbytes must be an integer in 0..{MAX_TENSOR_BYTES}")
        # Python ints: a product of hostile dims cannot overflow
        want = math.prod(self.shape) * DTYPES[self.dtype].itemsize
        require(self.nbytes == want, f"nbytes {self.nbytes} does not match shape "
                f"{self.shape} of {self.dtype} ({want} bytes)")


@register
class FramedHeader(Message):
    """Frame 0 of a framed message."""

    KIND: ClassVar[str] = "framed_header"
    payload: bytes  # the encoded message (a full envelope, checked on its own)
    tensors: tuple[TensorSpec, ...]  # one spec per following frame, in order

    def __post_init__(self) -> None:
        require(0 < len(self.payload) <= MAX_MESSAGE_BYTES, "payload must be a non-empty encoded message")
        require(len(self.tensors) <= MAX_TENSORS, f"tensors must be at most {MAX_TENSORS} TensorSpec values")
        total = sum(t.nbytes for t in self.tensors)
        if total > MAX_TENSOR_BYTES:
            raise ProtocolError(f"tensors total {total} bytes, over the "
                                f"{MAX_TENSOR_BYTES}-byte limit", "too_large")

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _wire_dtype(dt: np.dtype) -> str:
    """The wire name for a numpy dtype, matching kind and size so that both
    byte orders of the same type are accepted (bytes are sent little-endian)."""
    if dt.name == "bfloat16" and dt.itemsize == 2:  # ml_dtypes
        return "bfloat16"
    for name, wire in DTYPES.items():
        if dt.kind == wire.kind and dt.itemsize == wire.itemsize:
            return name
    raise ProtocolError(f"tensor dtype {dt} is not allowed; use one of {tuple(DTYPES)} "
                        "(bfloat16 as uint16 bits)")


def encode_frames(msg: Any, tensors: Sequence[np.ndarray], *,
                  max_tensor_bytes: int | None = None) -> list[bytes | memoryview]:
    """[header, tensor bytes...] for msg and tensors, ready for send_multipart.

    Tensor frames are memoryviews of the arrays (or of a C-order little-endian
    copy when an array is not already one); keep the arrays unchanged until
    the frames are sent. Raises ProtocolError for a disallowed dtype or size."""
    if isinstance(msg, FramedHeader):
        raise ProtocolError("a framed message cannot carry a FramedHeader")
    if not isinstance(tensors, Sequence) or isinstance(tensors, np.ndarray):
        raise ProtocolError("tensors must be a sequence of numpy arrays")
    if len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"{len(tensors)} tensors, over the limit of {MAX_TENSORS}", "too_large")
    limit = MAX_TENSOR_BYTES if max_tensor_bytes is None else max_tensor_bytes
    specs: list[TensorSpec] = []
    frames: list[bytes | memoryview] = []
    total = 0
    for i, arr in enumerate(tensors):
        if not isinstance(arr, np.ndarray):
            raise ProtocolError(f"tensor {i} is a {type(arr).__name__}, not a numpy array")
        name = _wire_dtype(arr.dtype)
        if arr.dtype.kind == "V":  # ml_dtypes bfloat16: its bits as uint16
            arr = arr.view(np.uint16)
        wire = DTYPES[name]
        if arr.dtype != wire or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=wire, order="C")  # np.array keeps 0-d shapes
        total += arr.nbytes
        if total > limit:
            raise ProtocolError(f"tensors total over the {limit}-byte limit", "too_large")
        specs.append(TensorSpec(name, tuple(int(d) for d in arr.shape), int(arr.nbytes)))
        frames.append(memoryview(arr.reshape(-1).view(np.uint8)))  # flat bytes, no copy
    header = FramedHeader(encode(msg), tuple(specs))
    return [encode(header), *frames]


def decode_frames(frames: Sequence[Any], *, max_bytes: int | None = None,
                  max_tensor_bytes: int | None = None) -> tuple[Any, list[np.ndarray]]:
    """(msg, arrays) from frames made by encode_frames. Frames may be bytes,
    bytearray, memoryview or anything with the buffer protocol (zmq.Frame).
    Arrays are views of the frames (read-only for bytes). Raises ProtocolError
    (and only that) for any mismatch or limit."""
    if not isinstance(frames, Sequence) or isinstance(frames, (bytes, bytearray, str)):
        raise ProtocolError("frames must be a list of byte frames")
    if not frames:
        raise ProtocolError("no frames")
    if len(frames) > MAX_TENSORS + 1:
        raise ProtocolError(f"{len(frames)} frames, over the limit of {MAX_TENSORS + 1}",
                            "too_large")
    header = decode(frames[0], max_bytes=max_bytes)
    if not isinstance(header, FramedHeader):
        raise ProtocolError(f"frame 0 must be a framed_header, got {header.KIND}")
    if len(frames) - 1 != len(header.tensors):
        raise ProtocolError(f"header announces {len(header.tensors)} tensor frame(s), "
                            f"got {len(frames) - 1}")
    limit = MAX_TENSOR_BYTES if max_tensor_bytes is None else max_tensor_bytes
    if header.total_bytes > limit:
        raise ProtocolError(f"tensors total {header.total_bytes} bytes, over the "
                            f"{limit}-byte limit", "too_large")
    msg = decode(header.payload, max_bytes=max_bytes)
    if isinstance(msg, FramedHeader):
        raise ProtocolError("a framed message cannot carry a FramedHeader")
    arrays = [_tensor(frame, spec, i) for i, (frame, spec)
              in enumerate(zip(frames[1:], header.tensors), start=1)]
    return msg, arrays


def _tensor(frame: Any, spec: TensorSpec, i: int) -> np.ndarray:
    """A view of one frame as the array spec describes."""
    try:
        mv = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"frame {i} is a {type(frame).__name__}, not bytes") from None
    if not mv.c_contiguous:
        raise ProtocolError(f"frame {i} is not contiguous")
    if mv.nbytes != spec.nbytes:
        raise ProtocolError(f"frame {i} has {mv.nbytes} bytes, header says {spec.nbytes}")
    try:
        flat = mv if (mv.ndim == 1 and mv.format in ("B", "b", "c")) else mv.cast("B")
        arr = np.frombuffer(flat, dtype=DTYPES[spec.dtype]).reshape(spec.shape)
    except Exception as e:
        raise ProtocolError(f"frame {i}: cannot view as {spec.dtype}{list(spec.shape)} "
                            f"({type(e).__name__})") from None
    # Only 0 and 1 are bools; other bytes would make values that compare oddly.
    if spec.dtype == "bool" and arr.size and int(arr.view(np.uint8).max()) > 1:
        raise ProtocolError(f"frame {i}: bool tensor holds bytes other than 0 and 1")
    return arr

"""Weights held in their storage dtype (bf16, fp16 or int8 with a scale per row), and
the one matmul over them (`linear`), in one of two ways.

The torch engines (MoE, sparse) keep a checkpoint's weights as it ships: bf16 stays
bf16 in RAM, so a model takes its own size and not twice it. A matmul then runs

- widened: each weight element widened to float32, times f32 activations. A bf16 weight
  widens exactly, so the result equals transformers computing in f32 on the very same
  weights, on every CPU: what exact mode (`--precision f32`) and the equivalence tests
  use. For up to `widen_kernel.ROWS` rows of activations (a decode step) the weight is
  widened as it is read, in cache-sized pieces, and never written back whole
  (`engine/runtime/widen_kernel.py`); for more (a prefill) it is widened `BLOCK_BYTES` at
  a time (the transient stays small even for a 150k-row head or a 14336-wide Mixtral
  expert) for a BLAS sgemm.
- native: in the weight's own 16-bit dtype, the activations rounded to it, f32
  accumulation in the kernel and a result rounded to the weight's dtype (what
  transformers in bf16 and llama.cpp do).

`linear(..., native_rows=n)` runs native when x has at most n rows, widened otherwise.
`native_rows(dtype)` is every row count (`ALL_ROWS`) where torch has a 16-bit kernel of
its own (oneDNN on AVX512-BF16/AMX, AVX512-FP16), and none where it has not (AVX2 only, as
many PC CPUs): torch then emulates the 16-bit product, each further row of activations
costing about as much again, while the widening kernel reads the weight once for all
rows (on an AVX2 AMD EPYC, by hand, a Qwen3-30B-A3B expert: faster from one row on).
`flotilla bench moe` records which ran (`compute`).

int8 (`quantize_rows`): symmetric, one f32 scale per output row, absmax / 127; always
widened (the scale applies per row).
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F

from engine.runtime import widen_kernel

ALL_ROWS = sys.maxsize  # native_rows: every matmul in the weight's own 16-bit dtype
BLOCK_BYTES = 8 << 20  # f32 bytes of weight widened at once (8 MiB: a few rows of a big matrix)
STORAGE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
# safetensors dtype names -> torch dtypes (TensorFile reads them; the MoE converter writes them)
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    """"bf16" for torch.bfloat16, and so on (STORAGE_DTYPES' keys)."""
    for name, d in STORAGE_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported weight dtype {dtype}")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (int8 [out, in], f32 scale [out]); rows a block at a time."""
    out = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    step = _rows_per_block(w.shape[1])
    for r0 in range(0, w.shape[0], step):
        block = w[r0:r0 + step].float()  # [rows, in]
        s = block.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [rows]
        out[r0:r0 + step] = torch.round(block / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[r0:r0 + step] = s
    return out, scale


def widen(w: torch.Tensor, scale: torch.Tensor | None, r0: int = 0, r1: int | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0:r1 of a stored weight as float32 [rows, in] (into `out` when given)."""
    src = w[r0:r1]
    block = src.float() if out is None else out[:src.shape[0]].copy_(src)
    if scale is not None:
        block *= scale[r0:r1, None]
    return block


_scratch = threading.local()  # per thread: one reused f32 block (no allocation, no page faults per call)


def _block(rows: int, cols: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        buf = _scratch.buf = torch.empty(max(rows * cols, BLOCK_BYTES // 4), dtype=torch.float32)
    return buf[:rows * cols].view(rows, cols)


def native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU's torch multiplies `dtype` (bf16/fp16) matrices with a kernel of
    its own (oneDNN on AVX512-BF16/AMX, AVX512-FP16), rather than emulating it."""
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return probe is not None and bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def native_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of activations a `dtype` weight multiplies fastest in its own
    dtype on this CPU (0: never -- widened -- a 32-bit or int8 weight, or a CPU without a
    16-bit kernel): see the module doc."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    return ALL_ROWS if native_matmul(dtype) else 0


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, native_rows: int = 0) -> torch.Tensor:
    """x [..., in] f32 @ w[out, in].T (+ bias) -> [..., out] f32, w in its storage dtype;
    a 16-bit weight multiplies in its own dtype when x has at most `native_rows` rows
    (the module doc), else widened."""
    if w.dtype == torch.float32 and scale is None:
        return F.linear(x, w, bias)
    n = x.numel() // max(1, x.shape[-1])  # rows of activations
    if native_rows and scale is None and w.dtype in (torch.bfloat16, torch.float16) and n <= native_rows:
        # x copied into fresh row-major storage: a strided x (the last position of a
        # prefill, hidden[:, -1:, :]) sends torch's 16-bit linear down a path that copies
        # the whole weight -- 1 GB for Llama-3-8B's head
        xw = torch.empty(x.shape, dtype=w.dtype).copy_(x)
        out = F.linear(xw, w).float()
        return out if bias is None else out + bias
    if 0 < n <= widen_kernel.ROWS and widen_kernel.handles(w):
        out = widen_kernel.matmul(x.reshape(n, x.shape[-1]), w, scale).view(*x.shape[:-1], w.shape[0])
        return out if bias is None else out + bias
    rows = w.shape[0]
    step = min(rows, _rows_per_block(w.shape[1]))
    buf = _block(step, w.shape[1])
    if step >= rows:
        return F.linear(x, widen(w, scale, out=buf), bias)
    out = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
    for r0 in range(0, rows, step):  # out[:, r0:r1] = x @ w[r0:r1].T, the block widened
        out[..., r0:r0 + step] = F.linear(x, widen(w, scale, r0, r0 + step, out=buf))
    if bias is not None:
        out += bias
    return out


def _rows_per_block(cols: int) -> int:
    return max(1, BLOCK_BYTES // (4 * max(1, cols)))


class StoredLinear(torch.nn.Module):
    """nn.Linear's forward over a weight kept in its storage dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, native_rows: int = 0) -> None:
        super().__init__()
        self.weight, self.scale = weight, scale  # plain tensors: never trained, never moved
        self.bias = None if bias is None else bias.float()
        self.native_rows = native_rows  # up to this many rows in the weight's 16-bit dtype (the module doc)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.bias) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scale, self.bias, self.native_rows)


class StoredEmbedding(torch.nn.Module):
    """nn.Embedding's lookup over a table kept in its storage dtype (rows widened on lookup).
    `mapped`: the table is a view of its file (mapped_tensor), not held in RAM."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, mapped: bool = False) -> None:
        super().__init__()
        self.weight, self.scale, self.mapped = weight, scale, mapped

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (None if self.mapped else self.weight, self.scale)
                   if t is not None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[ids].float()  # [..., H]
        if self.scale is not None:
            rows *= self.scale[ids][..., None]
        return rows


def mapped_tensor(path, offset: int, shape, st_dtype: str) -> torch.Tensor:
    """A read-only view of one tensor's bytes in a file, through a mapping of those bytes only.
    Nothing is read until used: the OS pages in what a lookup touches and may drop it again.
    For an input embedding, which a token reads one row of: held whole, Llama-3-8B's is
    1 GB in bf16, Qwen3-30B-A3B's 0.6 GB. Its own mapping, because a view into a mapping
    shared with other loads would keep every page they touched mapped as long as it lives."""
    import mmap
    import warnings

    dtype = ST_DTYPES[st_dtype]
    count = 1
    for d in shape:
        count *= int(d)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets are granularity-aligned
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), offset - start + count * dtype.itemsize, access=mmap.ACCESS_READ, offset=start)
    with warnings.catch_warnings():  # a read-only buffer: nothing writes into it
        warnings.simplefilter("ignore")
        return torch.frombuffer(m, dtype=dtype, count=count, offset=offset - start).reshape(tuple(shape))


class TensorFile:
    """Tensors of one safetensors file read into anonymous memory, one at a time.

    safetensors' own loader hands out views of an mmap: those pages are page cache, which
    the OS may drop and read again under memory pressure (a cap, a busy PC) and which a
    memory budget would count as free. Resident weights must be the process's own, so
    each tensor is read with plain reads into a fresh tensor, and its file range is then
    dropped from the page cache where the OS allows it (posix_fadvise), so a load does
    not leave the file's bytes behind in RAM too."""

    def __init__(self, path) -> None:
        import json
        import struct

        self.path = path
        self._f = open(path, "rb", buffering=0)
        n = struct.unpack("<Q", self._f.read(8))[0]
        head = json.loads(self._f.read(n))
        head.pop("__metadata__", None)
        self._base = 8 + n
        self._head = head

    def keys(self) -> list[str]:
        return list(self._head)

    def get(self, name: str) -> torch.Tensor:
        import os

        info = self._head[name]
        start, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=ST_DTYPES[info["dtype"]])
        view = memoryview(t.view(torch.uint8).numpy().reshape(-1)) if t.numel() else memoryview(b"")
        done = 0
        while done < end - start:
            self._f.seek(self._base + start + done)
            got = self._f.readinto(view[done:])
            if not got:
                raise OSError(f"{self.path} ends inside tensor {name}")
            done += got
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._f.fileno(), self._base + start, end - start, os.POSIX_FADV_DONTNEED)
        return t

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor as a view of the file (mapped_tensor), not a copy."""
        info = self._head[name]
        return mapped_tensor(self.path, self._base + info["data_offsets"][0], info["shape"], info["dtype"])

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

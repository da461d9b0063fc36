"""The few-row matmul over weights kept in 16-bit or int8: x [K, in] f32 @ w[out, in].T, each
weight element widened to float32 as it is read and used for every row of x at once.

A decode step multiplies a few rows of activations (one per request, or the few a MoE
expert gets) by big weights kept as the checkpoint ships them. Where torch has no 16-bit
kernel (AVX2-only CPUs, as many PCs) its two ways both pay for that: widening writes an f32
copy of the weight and reads it again (`stored.linear`'s blocks), and its emulated bf16
product costs as much again for every further row and rounds the activations to bf16.
Here a task widens four weight rows into a small buffer that stays in the core's cache and
multiplies them with every row of x (two at a time, eight running sums), so the stored
bytes are read from memory once and the arithmetic is f32 throughout. A bf16/fp16/int8
weight widens exactly, so the product equals transformers computing in f32 on the same
weights up to the order of the sums (the tests hold it to f32 rounding).

For many rows (a prefill) the weight's reads no longer dominate and a BLAS sgemm over
widened blocks is faster: `stored.linear` hands this kernel at most `ROWS` rows.

`expert` is a MoE expert's whole gated FFN in one call (rows gathered, gate and up, SiLU,
down, the routing-weighted add), so a decode step's expert costs its weight reads and not
a dozen small torch calls besides.

Compiled by numba (LLVM, for the CPU it runs on) into numba's on-disk cache next to
`_widen_jit.py` (or its per-user cache where that folder is read-only), so a process only
loads them: `warm()`, before a capped engine sizes its cache, compiles them in a short-lived
child process when the cache lacks them, so what the compiler takes is given back (a frozen
app too: its bundle ships `_widen_jit.py` as a source file for numba to key on). Parallel over
output rows on torch's thread count, without the GIL (the expert readers run meanwhile).
numba's thread pools differ by platform (OpenMP or TBB, else its own `workqueue`, which must
not be entered from two threads at once), so calls are serialized: two engines in one
process would share the cores anyway.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import torch

ROWS = 24  # up to this many rows of x: the kernel; more: stored.linear's widened blocks + sgemm
_KINDS = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.int8: "INT8"}  # -> _widen_jit's kind constants
_lock = threading.Lock()
_module = None  # engine.runtime._widen_jit, once imported


def handles(w: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: 16-bit or int8, 2-D, rows contiguous."""
    return w.dtype in _KINDS and w.dim() == 2 and w.is_contiguous()


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [K, in] f32 @ widen(w)[out, in].T -> [K, out] f32 (int8: times `scale` [out] per column)."""
    kind = _kind(w.dtype)
    xs = np.ascontiguousarray(x.detach().float().numpy())  # [K, in]
    ws = _bits(w)  # [out, in], no copy
    out = np.empty((xs.shape[0], ws.shape[0]), dtype=np.float32)  # [K, out]
    kernel = _jit().kernel
    with _lock:
        _threads()
        kernel(xs, ws, kind, out)
    result = torch.from_numpy(out)
    if scale is not None:
        result *= scale
    return result


def expert(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor, gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None,
           acc: torch.Tensor) -> None:
    """A MoE expert's gated SiLU FFN on x's rows `rows`, fused into one call:
    acc[rows[k]] += weights[k] * down(silu(gate(x[rows[k]])) * up(x[rows[k]])).

    x, acc [N, H] f32 contiguous (acc is added to in place); rows [m] int64, no row twice,
    m at most ROWS; weights [m] f32; gate_up [2I, H] (gate's rows, then up's) and down
    [H, I] of one kind (`handles`), int8 with their row scales. The gathers, the activation
    and the weighted adds happen in the kernel, between the two products, so a decode
    step's expert costs its weight reads and not a dozen small torch calls."""
    kind = _kind(gate_up.dtype)
    none = np.empty(0, dtype=np.float32)
    mid = np.empty((rows.shape[0], down.shape[1]), dtype=np.float32)  # [m, I]
    kernel = _jit().expert
    with _lock:
        _threads()
        kernel(x.numpy(), rows.numpy(), weights.detach().float().contiguous().numpy(), _bits(gate_up), _bits(down),
               kind, none if gate_up_scale is None else gate_up_scale.numpy(),
               none if down_scale is None else down_scale.numpy(), mid, acc.numpy())


def warm() -> None:
    """Have the kernels ready now, so the first decode step does not compile them and a
    capped process has paid their memory before it decides how much is left. Where numba's
    disk cache lacks them they are compiled in a child process that then exits: what the
    compiler takes is given back, and this process only loads them (if the child fails, they
    are compiled here)."""
    jit = _jit()
    if not jit.on_disk():
        subprocess.run([sys.executable, "-m", "engine.runtime._widen_jit"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=600, check=False)
    with _lock:
        jit.compile_all()


def _bits(w: torch.Tensor) -> np.ndarray:
    """w's elements as numpy sees them, no copy: int8 as is, 16-bit as their uint16 bits."""
    return w.numpy() if w.dtype == torch.int8 else w.view(torch.int16).numpy().view(np.uint16)


def _kind(dtype: torch.dtype) -> int:
    return getattr(_jit(), _KINDS[dtype])


def _threads() -> None:
    """numba's threads for this call: torch's count (numba keeps one per calling thread)."""
    import numba

    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def _jit():
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                from engine.runtime import _widen_jit  # imports numba, compiles (or loads) the kernels

                _module = _widen_jit
    return _module

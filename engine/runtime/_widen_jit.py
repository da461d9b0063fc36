"""The compiled loops of `widen_kernel` (imported on first use: importing numba costs time
and memory a process without 16-bit weights never pays). Only numpy and numba here, so that
`python -m engine.runtime._widen_jit` compiles them into numba's disk cache in a small child
process (`widen_kernel.warm`).

numba keys its disk cache on this file: the app's bundle ships it as a source file
(installers/flotilla.spec), so a frozen app caches the loops too (in its own folder, or the
user's cache folder where that is read-only), keyed on the executable."""

import os

import numpy as np
from numba import njit, prange

BF16, FP16, INT8 = 0, 1, 2  # how a weight's elements widen (the `kind` argument)

# sums may be reordered (vectorized) and multiply-adds fused; no assumption about NaN/inf
FAST = {"reassoc", "contract", "nsz"}
TASK_ROWS = 32  # output rows per parallel task


@njit(inline="always")
def widen_row(w, j, kind, bits, wide, r):
    """wide[r] = float32(w[j]), through its bits (bits and wide share memory)."""
    if kind == BF16:  # bf16 is the top half of an f32
        for h in range(w.shape[1]):
            bits[r, h] = np.uint32(w[j, h]) << 16
    elif kind == FP16:
        for h in range(w.shape[1]):  # exponent and mantissa moved into an f32's place ...
            bits[r, h] = (np.uint32(w[j, h]) & 0x7FFF) << 13
        for h in range(w.shape[1]):  # ... and the exponent rebiased (exact, subnormals too)
            wide[r, h] *= np.float32(5.192296858534828e33)  # 2**112
        for h in range(w.shape[1]):  # inf/NaN keep an all-ones exponent; the sign goes back on
            v = np.uint32(w[j, h])
            b = bits[r, h]
            if (v & 0x7C00) == 0x7C00:
                b = ((v & 0x3FF) << 13) | 0x7F800000
            bits[r, h] = b | ((v & 0x8000) << 16)
    else:
        for h in range(w.shape[1]):
            wide[r, h] = np.float32(w[j, h])


@njit(inline="always")
def scratch(width):
    """Four weight rows' room, as bits and as the f32 values they are (one buffer)."""
    bits = np.zeros((4, width), np.uint32)
    return bits, bits.view(np.float32)


@njit(inline="always")
def span(t, total):
    """The output rows [start, end) of parallel task t."""
    return t * TASK_ROWS, min(total, (t + 1) * TASK_ROWS)


@njit(inline="always")
def widen_rows(w, j, end, kind, bits, wide):
    """Rows j.. of w, four or up to `end`, widened into wide[0..]; how many."""
    n = min(4, end - j)
    for r in range(n):
        widen_row(w, j + r, kind, bits, wide, r)
    return n


@njit(inline="always")
def dot4(v, wide):
    """One row of activations against the four widened weight rows: four sums."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    for h in range(v.shape[0]):
        a = v[h]
        s0 += a * wide[0, h]
        s1 += a * wide[1, h]
        s2 += a * wide[2, h]
        s3 += a * wide[3, h]
    return s0, s1, s2, s3


@njit(inline="always")
def put(out, k, j, n, s0, s1, s2, s3):
    out[k, j] = s0
    if n > 1:
        out[k, j + 1] = s1
    if n > 2:
        out[k, j + 2] = s2
    if n > 3:
        out[k, j + 3] = s3


@njit(parallel=True, fastmath=FAST, cache=True, nogil=True)
def kernel(x, w, kind, out):
    k_rows, width = x.shape
    j_rows = w.shape[0]
    for t in prange((j_rows + TASK_ROWS - 1) // TASK_ROWS):
        bits, wide = scratch(width)  # four weight rows, widened (past a tail: unused)
        j, end = span(t, j_rows)
        while j < end:
            n = widen_rows(w, j, end, kind, bits, wide)
            k = 0
            while k + 2 <= k_rows:  # two rows of x against the four weight rows
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                for h in range(width):
                    x0 = x[k, h]
                    x1 = x[k + 1, h]
                    w0 = wide[0, h]
                    w1 = wide[1, h]
                    w2 = wide[2, h]
                    w3 = wide[3, h]
                    a0 += x0 * w0
                    a1 += x0 * w1
                    a2 += x0 * w2
                    a3 += x0 * w3
                    b0 += x1 * w0
                    b1 += x1 * w1
                    b2 += x1 * w2
                    b3 += x1 * w3
                put(out, k, j, n, a0, a1, a2, a3)
                put(out, k + 1, j, n, b0, b1, b2, b3)
                k += 2
            if k < k_rows:
                a0, a1, a2, a3 = dot4(x[k], wide)
                put(out, k, j, n, a0, a1, a2, a3)
            j += 4


@njit(inline="always")
def _silu(v):
    return v / (np.float32(1.0) + np.exp(-v))


@njit(parallel=True, fastmath=FAST, cache=True, nogil=True)
def expert(x, rows, weights, gate_up, down, kind, gate_up_scale, down_scale, mid, acc):
    """acc[rows[k]] += weights[k] * down(silu(gate(x[rows[k]])) * up(x[rows[k]])) for every k.

    gate_up [2I, H]: gate's rows then up's; down [H, I]; a scale array is empty for a
    16-bit weight, else one f32 per output row (int8); mid [m, I] is scratch. A token
    picks an expert once, so rows holds no row twice and the adds never race."""
    m, width = rows.shape[0], x.shape[1]
    inter = down.shape[1]
    for t in prange((inter + TASK_ROWS - 1) // TASK_ROWS):  # mid = silu(gate) * up, [m, I]
        bits, wide = scratch(width)  # gate j, up j, gate j+1, up j+1
        j, end = span(t, inter)
        while j < end:
            two = j + 1 < end
            widen_row(gate_up, j, kind, bits, wide, 0)
            widen_row(gate_up, inter + j, kind, bits, wide, 1)
            if two:
                widen_row(gate_up, j + 1, kind, bits, wide, 2)
                widen_row(gate_up, inter + j + 1, kind, bits, wide, 3)
            for k in range(m):
                g0, u0, g1, u1 = dot4(x[rows[k]], wide)
                if gate_up_scale.shape[0]:
                    g0 *= gate_up_scale[j]
                    u0 *= gate_up_scale[inter + j]
                    if two:
                        g1 *= gate_up_scale[j + 1]
                        u1 *= gate_up_scale[inter + j + 1]
                mid[k, j] = _silu(g0) * u0
                if two:
                    mid[k, j + 1] = _silu(g1) * u1
            j += 2
    for t in prange((width + TASK_ROWS - 1) // TASK_ROWS):  # acc[rows] += weights * (mid @ down.T)
        bits, wide = scratch(inter)
        j, end = span(t, width)
        while j < end:
            n = widen_rows(down, j, end, kind, bits, wide)
            for k in range(m):
                sums = dot4(mid[k], wide)
                r = rows[k]
                for q in range(n):
                    s = sums[q]
                    if down_scale.shape[0]:
                        s *= down_scale[j + q]
                    acc[r, j + q] += weights[k] * s
            j += 4


def compile_all() -> None:
    """Compile (or load) both loops for 16-bit and int8 weights, on tiny arrays."""
    x, rows, one = np.zeros((2, 4), np.float32), np.zeros(1, np.int64), np.ones(1, np.float32)
    none = np.empty(0, np.float32)
    for kind, w in ((BF16, np.zeros((4, 4), np.uint16)), (INT8, np.zeros((4, 4), np.int8))):
        scale = np.ones(4, np.float32) if kind == INT8 else none
        kernel(x, w, kind, np.empty((2, 4), np.float32))
        expert(x, rows, one, w, w[:, :2].copy(), kind, scale, scale, np.empty((1, 2), np.float32),
               np.zeros((2, 4), np.float32))


def on_disk() -> bool:
    """Whether numba's disk cache already holds both loops (then a process only loads them)."""
    try:
        return all(os.path.exists(f._cache._cache_file._index_path) for f in (kernel, expert))
    except AttributeError:  # numba's internals moved
        return False


if __name__ == "__main__":
    compile_all()

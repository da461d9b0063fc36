"""The compiled loop of `widen_kernel` (imported on first use: importing numba costs time
and memory a process without 16-bit weights never pays)."""

import sys

import numpy as np
from numba import njit, prange

from engine.runtime.widen_kernel import BF16, FP16

# sums may be reordered (vectorized) and multiply-adds fused; no assumption about NaN/inf
FAST = {"reassoc", "contract", "nsz"}
# a frozen app (PyInstaller) has no source files for numba's disk cache to key on
CACHE = not getattr(sys, "frozen", False)
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
def put(out, k, j, n, s0, s1, s2, s3):
    out[k, j] = s0
    if n > 1:
        out[k, j + 1] = s1
    if n > 2:
        out[k, j + 2] = s2
    if n > 3:
        out[k, j + 3] = s3


@njit(parallel=True, fastmath=FAST, cache=CACHE, nogil=True)
def kernel(x, w, kind, out):
    k_rows, width = x.shape
    j_rows = w.shape[0]
    for t in prange((j_rows + TASK_ROWS - 1) // TASK_ROWS):
        bits = np.zeros((4, width), np.uint32)  # four weight rows, widened (past a tail: unused)
        wide = bits.view(np.float32)
        end = min(j_rows, (t + 1) * TASK_ROWS)
        j = t * TASK_ROWS
        while j < end:
            n = min(4, end - j)
            for r in range(n):
                widen_row(w, j + r, kind, bits, wide, r)
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
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for h in range(width):
                    x0 = x[k, h]
                    a0 += x0 * wide[0, h]
                    a1 += x0 * wide[1, h]
                    a2 += x0 * wide[2, h]
                    a3 += x0 * wide[3, h]
                put(out, k, j, n, a0, a1, a2, a3)
            j += 4


@njit(inline="always")
def _silu(v):
    return v / (np.float32(1.0) + np.exp(-v))


@njit(parallel=True, fastmath=FAST, cache=CACHE, nogil=True)
def expert(x, rows, weights, gate_up, down, kind, gate_up_scale, down_scale, mid, acc):
    """acc[rows[k]] += weights[k] * down(silu(gate(x[rows[k]])) * up(x[rows[k]])) for every k.

    gate_up [2I, H]: gate's rows then up's; down [H, I]; a scale array is empty for a
    16-bit weight, else one f32 per output row (int8); mid [m, I] is scratch. A token
    picks an expert once, so rows holds no row twice and the adds never race."""
    m, width = rows.shape[0], x.shape[1]
    inter = down.shape[1]
    for t in prange((inter + TASK_ROWS - 1) // TASK_ROWS):  # mid = silu(gate) * up, [m, I]
        bits = np.zeros((4, width), np.uint32)  # gate j, up j, gate j+1, up j+1
        wide = bits.view(np.float32)
        end = min(inter, (t + 1) * TASK_ROWS)
        j = t * TASK_ROWS
        while j < end:
            two = j + 1 < end
            widen_row(gate_up, j, kind, bits, wide, 0)
            widen_row(gate_up, inter + j, kind, bits, wide, 1)
            if two:
                widen_row(gate_up, j + 1, kind, bits, wide, 2)
                widen_row(gate_up, inter + j + 1, kind, bits, wide, 3)
            for k in range(m):
                r = rows[k]
                g0 = u0 = g1 = u1 = np.float32(0.0)
                for h in range(width):
                    xv = x[r, h]
                    g0 += xv * wide[0, h]
                    u0 += xv * wide[1, h]
                    g1 += xv * wide[2, h]
                    u1 += xv * wide[3, h]
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
        bits = np.zeros((4, inter), np.uint32)
        wide = bits.view(np.float32)
        end = min(width, (t + 1) * TASK_ROWS)
        j = t * TASK_ROWS
        while j < end:
            n = min(4, end - j)
            for q in range(n):
                widen_row(down, j + q, kind, bits, wide, q)
            for k in range(m):
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for i in range(inter):
                    v = mid[k, i]
                    s0 += v * wide[0, i]
                    s1 += v * wide[1, i]
                    s2 += v * wide[2, i]
                    s3 += v * wide[3, i]
                sums = (s0, s1, s2, s3)
                r = rows[k]
                for q in range(n):
                    s = sums[q]
                    if down_scale.shape[0]:
                        s *= down_scale[j + q]
                    acc[r, j + q] += weights[k] * s
            j += 4

"""engine/runtime/stored.py: the one matmul over weights kept in their storage dtype,
widened (exact against f32) or native (in the weight's 16-bit dtype), and for how many rows
each runs on this CPU. The widening kernel a decode step's few rows go through has its own
tests (test_widen_kernel.py)."""

from __future__ import annotations

import pytest
import torch

from engine.runtime import stored
from engine.runtime import widen_kernel
from engine.runtime.stored import (ALL_ROWS, BLOCK_BYTES, StoredLinear, linear, native_matmul, native_rows,
                                   quantize_rows)


def _weights(rows: int, cols: int, seed: int = 0, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(n, cols, generator=g)
    return w, x


@pytest.mark.parametrize("n", [5, widen_kernel.ROWS + 1])  # a decode step's rows (the kernel), a prefill's
@pytest.mark.parametrize("rows", [64, 3 * BLOCK_BYTES // (4 * 256) + 7])  # one block, and several with a tail
def test_widened_equals_f32_math_on_the_same_weights(rows, n):
    w, x = _weights(rows, 256, n=n)
    bias = torch.randn(rows)
    got = linear(x, w, bias=bias)
    want = torch.nn.functional.linear(x, w.float(), bias)
    assert got.dtype == torch.float32 and got.shape == (n, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_runs_in_the_weights_dtype_and_stays_close():
    w, x = _weights(96, 512)
    exact = linear(x, w)
    native = linear(x, w, native_rows=ALL_ROWS)
    assert native.dtype == torch.float32
    # what transformers computes in bf16: activations rounded to bf16, the product rounded once
    want = torch.nn.functional.linear(x.to(torch.bfloat16), w).float()
    torch.testing.assert_close(native, want, rtol=0, atol=0)
    rel = (native - exact).abs().max() / exact.abs().max()
    assert 0 < rel < 2e-2  # bf16 rounding, not a different product


def test_a_strided_input_gives_the_same_native_result():
    w, x = _weights(64, 128)
    wide = torch.randn(5, 3, 128)
    wide[:, -1, :] = x
    torch.testing.assert_close(linear(wide[:, -1, :], w, native_rows=ALL_ROWS), linear(x, w, native_rows=ALL_ROWS),
                               rtol=0, atol=0)


def test_int8_with_row_scales_is_always_widened():
    w, x = _weights(64, 128)
    q, scale = quantize_rows(w)
    widened = linear(x, q, scale)
    torch.testing.assert_close(linear(x, q, scale, native_rows=ALL_ROWS), widened, rtol=0, atol=0)
    torch.testing.assert_close(widened, torch.nn.functional.linear(x, q.float() * scale[:, None]),
                               rtol=1e-5, atol=1e-5)


def test_native_rows_picks_the_native_product_for_few_rows_and_widens_more():
    """native_rows=3: a decode step's 1-3 rows in the weight's bf16, a 4-row (or prefill)
    input widened, exactly each way -- the rows of a 3-D input count, not its first dim."""
    w, _x = _weights(96, 256)
    g = torch.Generator().manual_seed(1)
    for shape, native in (((1, 256), True), ((3, 256), True), ((1, 3, 256), True), ((4, 256), False),
                          ((2, 2, 256), False), ((64, 256), False)):
        x = torch.randn(*shape, generator=g)
        got = linear(x, w, native_rows=3)
        want = linear(x, w, native_rows=ALL_ROWS) if native else linear(x, w)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got, linear(x, w, native_rows=0 if native else ALL_ROWS))  # the two differ


def test_native_rows_follow_the_cpu(monkeypatch):
    """A CPU with a 16-bit kernel multiplies every row count natively; one without (AVX2)
    none (the widening kernel reads the weight once for all rows); f32 and int8 weights never."""
    assert native_rows(torch.float32) == 0 and native_rows(torch.int8) == 0
    monkeypatch.setattr(stored, "native_matmul", lambda dtype: True)
    assert native_rows(torch.bfloat16) == ALL_ROWS and native_rows(torch.float16) == ALL_ROWS
    monkeypatch.setattr(stored, "native_matmul", lambda dtype: False)
    assert native_rows(torch.bfloat16) == 0 and native_rows(torch.float16) == 0


def test_stored_linear_follows_its_native_rows():
    w, x = _weights(32, 64)
    layer = StoredLinear(w)
    assert layer.native_rows == 0
    torch.testing.assert_close(layer(x), linear(x, w), rtol=0, atol=0)
    layer.native_rows = ALL_ROWS
    torch.testing.assert_close(layer(x), linear(x, w, native_rows=ALL_ROWS), rtol=0, atol=0)


def test_native_matmul_answers_for_16_bit_dtypes_only(monkeypatch):
    assert native_matmul(torch.float32) is False and native_matmul(torch.int8) is False
    assert isinstance(native_matmul(torch.bfloat16), bool)

    class NoOneDNN:  # a torch build without oneDNN's probes
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(torch.ops, "mkldnn", NoOneDNN())
    assert native_matmul(torch.bfloat16) is False

"""engine/runtime/widen_kernel.py: a few rows of activations times a 16-bit or int8 weight,
each element widened to f32 as it is read -- the f32 product on the very same weights."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.runtime import stored, widen_kernel
from engine.runtime.stored import linear, quantize_rows


def _f32_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    wide = w.float() if scale is None else w.float() * scale[:, None]
    return torch.nn.functional.linear(x.double(), wide.double()).float()  # f32 inputs, exact sums


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, widen_kernel.ROWS])  # x's rows: odd counts leave a one-row tail
@pytest.mark.parametrize("out_features", [1, 3, 33, 130])  # tails of the four-row groups and 32-row tasks
def test_the_product_is_f32_math_on_the_same_weights(dtype, rows, out_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    cols = 515  # not a multiple of any vector width
    w = torch.randn(out_features, cols, generator=g) * 0.05
    scale = None
    if dtype == torch.int8:
        w, scale = quantize_rows(w)
    else:
        w = w.to(dtype)
    x = torch.randn(rows, cols, generator=g)
    got = widen_kernel.matmul(x, w, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    # only the order of the f32 sums differs from the exact product
    torch.testing.assert_close(got, _f32_reference(x, w, scale), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_value_widens_exactly(dtype):
    """All 65536 bit patterns (normal, subnormal, zeros, infinities, NaNs), each a one-column
    weight row times 1.0: the kernel's widening equals torch's conversion (a product's sum
    starts at +0.0, so -0.0 comes out as +0.0, as equal to it as f32 math says)."""
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 1)
    got = widen_kernel.matmul(torch.ones(1, 1), w)[0]
    want = w.float()[:, 0]
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[want != 0]), torch.signbit(want[want != 0]))
    if dtype == torch.float16:
        assert (want[~nan].abs() < 6.2e-5).sum() > 2000  # the subnormals were among them


def test_every_int8_value_widens_exactly():
    w = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).reshape(-1, 1)
    got = widen_kernel.matmul(torch.ones(1, 1), w, torch.ones(256))[0]
    assert torch.equal(got, torch.arange(-128, 128, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("inter", [1, 33, 70])  # odd widths: the gate's pairs and down's groups have tails
def test_an_experts_ffn_is_f32_math_added_into_its_rows_only(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    hidden, n = 130, 9
    gate_up = torch.randn(2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(hidden, inter, generator=g) * 0.1
    gs = ds = None
    if dtype == torch.int8:
        (gate_up, gs), (down, ds) = quantize_rows(gate_up), quantize_rows(down)
    else:
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    x = torch.randn(n, hidden, generator=g)
    rows, weights = torch.tensor([7, 2, 5]), torch.rand(3, generator=g)
    acc = torch.randn(n, hidden, generator=g)
    want = acc.clone()
    gate, up = _f32_reference(x[rows], gate_up, gs).chunk(2, dim=-1)
    out = _f32_reference(torch.nn.functional.silu(gate) * up, down, ds)
    want.index_add_(0, rows, out * weights[:, None])
    widen_kernel.expert(x, rows, weights, gate_up, down, gs, ds, acc)
    torch.testing.assert_close(acc, want, rtol=2e-5, atol=2e-6)
    others = [i for i in range(n) if i not in rows.tolist()]
    assert torch.equal(acc[others], want[others])  # the other rows untouched


def test_linear_sends_a_decode_steps_rows_to_the_kernel_and_a_prefills_to_blocks(monkeypatch):
    calls: list[int] = []
    matmul = widen_kernel.matmul

    def spy(x, w, scale=None):
        calls.append(x.shape[0])
        return matmul(x, w, scale)

    monkeypatch.setattr(widen_kernel, "matmul", spy)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(70, 96, generator=g) * 0.05).to(torch.bfloat16)
    for shape in ((1, 96), (1, 4, 96), (widen_kernel.ROWS, 96), (widen_kernel.ROWS + 1, 96), (3, 40, 96)):
        x = torch.randn(*shape, generator=g)
        calls.clear()
        got = linear(x, w)
        assert got.shape == (*shape[:-1], 70)
        n = x.numel() // 96
        assert calls == ([n] if n <= widen_kernel.ROWS else [])  # the rows of a 3-D input count
        torch.testing.assert_close(got, _f32_reference(x, w), rtol=2e-5, atol=2e-6)
    # a weight that is a strided view (not row-contiguous) goes the blocks' way, as right
    calls.clear()
    torch.testing.assert_close(linear(torch.ones(2, 70), w.t()), _f32_reference(torch.ones(2, 70), w.t()),
                               rtol=2e-5, atol=2e-6)
    assert calls == []


def test_a_16_bit_weight_is_widened_on_a_cpu_without_a_16_bit_kernel(monkeypatch):
    """Where torch only emulates bf16 (AVX2, faked here), a decode step's product is the
    kernel's f32 one, not a bf16-rounded one."""
    monkeypatch.setattr(stored, "native_matmul", lambda dtype: False)
    w = (torch.randn(40, 64, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    got = linear(x, w, native_rows=stored.native_rows(torch.bfloat16))
    torch.testing.assert_close(got, _f32_reference(x, w), rtol=2e-5, atol=2e-6)


def test_calls_from_several_threads_at_once_all_get_their_own_answer():
    g = torch.Generator().manual_seed(6)
    cases = [((torch.randn(48, 300, generator=g) * 0.05).to(torch.bfloat16), torch.randn(3, 300, generator=g))
             for _ in range(4)]
    want = [_f32_reference(x, w) for w, x in cases]
    wrong: list[int] = []

    def work(i: int) -> None:
        w, x = cases[i]
        for _ in range(50):
            if not torch.allclose(widen_kernel.matmul(x, w), want[i], rtol=2e-5, atol=2e-6):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_the_thread_count_follows_torch():
    import numba

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        widen_kernel.matmul(torch.ones(1, 8), torch.ones(4, 8, dtype=torch.bfloat16))
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

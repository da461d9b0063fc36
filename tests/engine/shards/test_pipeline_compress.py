"""int8 / int4 shards (NNCF weight compression): smaller, still fused, still close.

Closeness is measured teacher-forced: the f32 2-shard chain decodes greedily
for STEPS tokens from a prompt; the compressed chain is fed the same tokens
and its own argmax is compared with the f32 one at every step. A free-running
comparison would turn the first disagreement (two near-tied logits of a
random-weight model) into a different continuation, and every later position
would count as a miss although the model is fine; teacher forcing counts each
step's disagreement once. Both chains use exact f32 hints so that only the
weights differ.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ov = pytest.importorskip("openvino")
pytest.importorskip("nncf")

from engine.models.demo import cache_root, ensure_demo  # noqa: E402
from engine.shards.compress import compress_model, spec_for, weight_precisions  # noqa: E402
from engine.shards.export import ensure_shard  # noqa: E402
from engine.shards.runtime import ShardRunner  # noqa: E402

STEPS = 32
PROMPT = [17, 250, 9, 1021, 44, 600, 3, 77, 1500, 12, 830, 5]
RANGES = [(0, 4), (4, 8)]
# What "close" means, per precision, measured on demo (a random-weight model,
# initializer_range 0.1, whose logits are far more sensitive to weight noise
# than a trained model's: no outlier channels, a chaotic residual stream):
#   int8  measured 29/32 top-1 agreement, cosine 0.998, f32 token in the
#         int8 top-5 at every step. Asserted: >= 85% top-1 (a margin of two
#         near-ties under the measured value: the median top-1/top-2 logit gap
#         of demo is 0.37 against a logit spread of 1.1), cosine >= 0.99, top-5
#         always. A broken export (wrong scales, lost layer) fails all three.
#   int4  measured 6/32 top-1, cosine 0.78 (int4_sym, groups of 128; asym or
#         groups of 32 are no better than 0.31 / 0.85 on random weights).
#         Data-free int4 is not near-lossless on such a model, so only a
#         sanity floor is asserted: cosine >= 0.7 and top-1 >= 10% (chance
#         is 1/1512): the compressed graph still computes the same function,
#         coarsely.
CLOSE = {"int8": {"top1": 0.85, "cosine": 0.99, "top5": 1.0},
         "int4": {"top1": 0.10, "cosine": 0.70, "top5": 0.0}}


@pytest.fixture(scope="module")
def demo():
    path = ensure_demo("demo")
    blobs = cache_root() / "ov-blobs"
    shards: dict[str, list] = {}
    for precision in ("f32", "int8", "int4"):
        infos = [ensure_shard(path, s, e, num_layers_total=8, precision=precision)
                 for s, e in RANGES]
        shards[precision] = [ShardRunner(i, exact=True, cache_dir=blobs) for i in infos]
    return shards


def _step(streams, tokens: list[int], length: int) -> np.ndarray:
    """Run `tokens` through the chain after `length` cached ones; last logits [V]."""
    x = np.array([tokens], np.int64)
    n = len(tokens)
    out: dict = {}
    for i, stream in enumerate(streams):
        feed = {"attention_mask": np.ones((1, length + n), np.int64),
                "position_ids": np.arange(length, length + n, dtype=np.int64)[None],
                "input_ids" if i == 0 else "hidden_states": x}
        out = stream.run(feed)
        x = out.get("hidden_states_out")
    return out["logits"][0, -1]


def _greedy(runners) -> list[int]:
    """The chain's own greedy tokens after PROMPT."""
    streams = [r.new_stream() for r in runners]
    logits = _step(streams, PROMPT, 0)
    length, out = len(PROMPT), []
    for _ in range(STEPS):
        out.append(int(logits.argmax()))
        logits = _step(streams, [out[-1]], length)
        length += 1
    return out


def _forced_logits(runners, forced: list[int]) -> np.ndarray:
    """Last-position logits [STEPS, V] of a chain fed PROMPT, then `forced` tokens."""
    streams = [r.new_stream() for r in runners]
    rows = [_step(streams, PROMPT, 0)]
    length = len(PROMPT)
    for token in forced[:-1]:
        rows.append(_step(streams, [token], length))
        length += 1
    return np.array(rows)


def _bin_bytes(runner: ShardRunner) -> int:
    return os.path.getsize(runner.info.xml.with_suffix(".bin"))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_compressed_shards_are_smaller(demo, precision):
    for f32, small in zip(demo["f32"], demo[precision]):
        assert small.info.precision == precision
        # int8: 1 byte per weight + per-channel scales/zero points vs 4 bytes.
        # int4: 4-bit body with int8 embedding/head (NNCF backup) -> smaller still.
        limit = 0.30 if precision == "int8" else 0.25
        assert _bin_bytes(small) < limit * _bin_bytes(f32), (precision, _bin_bytes(small), _bin_bytes(f32))
    int8_total = sum(map(_bin_bytes, demo["int8"]))
    assert sum(map(_bin_bytes, demo["int4"])) < int8_total


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_compressed_shards_keep_fused_sdpa(demo, precision):
    for runner in demo[precision]:
        assert len(runner.fused_sdpa_nodes()) == runner.info.end - runner.info.start
        assert "beam_idx" in runner.input_names


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_compressed_chain_greedy_stays_close(demo, precision):
    reference = _greedy(demo["f32"])
    assert len(set(reference)) > 4  # a collapsed reference would prove nothing
    want = _forced_logits(demo["f32"], reference)
    assert [int(r.argmax()) for r in want] == reference  # forcing replays the f32 run
    got = _forced_logits(demo[precision], reference)
    top1 = float(np.mean(got.argmax(axis=1) == want.argmax(axis=1)))
    top5 = float(np.mean([w.argmax() in np.argsort(g)[-5:] for g, w in zip(got, want)]))
    cosine = float(np.mean(np.sum(got * want, axis=1)
                           / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))))
    close = CLOSE[precision]
    assert top1 >= close["top1"], (precision, top1)
    assert cosine >= close["cosine"], (precision, cosine)
    assert top5 >= close["top5"], (precision, top5)


def test_compress_model_stores_low_bit_weights():
    from openvino import opset13

    rng = np.random.default_rng(0)
    x = opset13.parameter([1, 256], np.float32, name="x")
    h = x
    for _ in range(3):  # NNCF keeps the last MatMul (the "head") in int8 for int4
        w = opset13.constant(rng.standard_normal((256, 256)).astype(np.float32))
        h = opset13.matmul(h, w, False, True)
    model = ov.Model([h], [x])
    assert set(weight_precisions(compress_model(model.clone(), "int8"))) == {"u8"}
    int4 = weight_precisions(compress_model(model.clone(), "int4"))
    assert int4.get("i4", 0) + int4.get("u4", 0) >= 2 and int4.get("u8", 0) >= 1, int4


def test_bad_compression_requests_are_rejected():
    with pytest.raises(ValueError):
        spec_for("fp16")
    with pytest.raises(ValueError):
        spec_for("int4", int4_mode="nf4")
    with pytest.raises(ValueError):
        spec_for("int4", group_size=0)
    assert spec_for("int4").group_size == 128 and spec_for("int8").group_size is None

"""Reads straight into the cache's slots (batched AIO, scatter reads), 16-bit
stores, and the disk probe's gap rule."""

import numpy as np
import pytest

from engine.runtime.chat import prompt_ids
from engine.sparse.engine import SparseBackend, SparseConfig, SparseEngine
from engine.sparse.store import BundleStore, CorruptStoreError, StoreConfig, build_store
from engine.sparse.weights import MappedWeights, ffn_layout
from engine_helpers import collect, reference_greedy
from test_sparse_engine import PROMPT, greedy

N = 16


@pytest.mark.parametrize("mode", ["exact", "predicted"])
def test_direct_reads_threshold_zero_equal_dense(wide_model, mode):
    budget = 5_000_000 if mode == "exact" else 10_000_000  # ~60 % of the FFN: streaming happens
    cfg = SparseConfig(mode=mode, sparsity=0.0, cache_budget_bytes=budget, kv_precision="f32")  # as dense keeps KV
    with SparseEngine(wide_model, "wide", cfg) as eng:
        assert eng.runtime.prefetcher.direct  # bundles land in cache slots, no copy
        ref = reference_greedy(wide_model, prompt_ids(eng.tokenizer, PROMPT), N)
        out, _, _ = collect(eng.generate(greedy("d", N)))
        assert out == ref
        assert eng.stats()["io"]["bytes_read"] > 0


def test_direct_reads_budget_moves_mid_generation(wide_model):
    cfg = SparseConfig(mode="exact", sparsity=0.0, cache_budget_bytes=7_000_000)
    with SparseEngine(wide_model, "wide", cfg) as eng:
        calm, _, _ = collect(eng.generate(greedy("calm", 30)))
        minimum = eng.backend.min_budget
        ids = []
        rid = eng.submit(greedy("moving", 30))
        for i, ev in enumerate(eng.stream(rid)):
            ids += ev.token_ids
            if i == 8:
                eng.set_cache_budget(minimum)
                c = eng.runtime.cache
                assert c.used_rows * c.row_bytes <= minimum and not c.pinned.any()
            if i == 18:
                eng.set_cache_budget(7_000_000)
        assert ids == calm


def test_damaged_bundle_is_detected_on_the_direct_path(tmp_path, wide_model):
    be = SparseBackend(wide_model, SparseConfig(mode="exact", sparsity=0.0, cache_budget_bytes=5_000_000))
    try:
        store = be.rt.store
        assert be.rt.prefetcher.direct
        f = store.file(1)
        with open(f, "r+b") as fh:  # flip a byte of neuron 5's payload
            fh.seek(5 * store.stride + 10)
            b = fh.read(1)
            fh.seek(5 * store.stride + 10)
            fh.write(bytes([b[0] ^ 0x55]))
        stream = be.new_stream()
        with pytest.raises(CorruptStoreError, match="neuron 5 fails its checksum"):
            stream.prefill([1, 2, 3, 4])
        assert be.rt.cache.slot_of[1, 5] < 0  # the damaged bundle was not kept
    finally:
        be.close()
        with open(f, "r+b") as fh:  # repair: the store is shared with other tests
            fh.seek(5 * store.stride + 10)
            fh.write(b)


def test_bf16_store_keeps_the_checkpoint_bits_and_matches_the_dense_path(wide_model_bf16):
    from engine.runtime.torch_backend import TorchStream
    from engine.sparse.weights import load_dense_mmap

    path = wide_model_bf16
    w, layout = MappedWeights(path), ffn_layout(path)
    cfg = SparseConfig(mode="exact", sparsity=0.0, cache_budget_bytes=3_000_000, kv_precision="f32")
    with SparseEngine(path, "wide-bf16", cfg) as eng:
        store = eng.runtime.store
        assert store.dtype == "bf16" and store.payload == 2 * 512 * 2
        ids = np.array([0, 7, 8, 1000])
        rows = store.read(1, ids)  # raw 16-bit words
        np.testing.assert_array_equal(rows[:, 0], w.raw(layout.key(1, "up"))[ids])
        np.testing.assert_array_equal(rows[:, 1], w.raw(layout.key(1, "down"))[:, ids].T)
        # threshold 0: the same tokens as the dense model computed with the same bf16 kernels
        prompt = prompt_ids(eng.tokenizer, PROMPT)
        dense = load_dense_mmap(path, resident=True)
        stream, ref = TorchStream(dense), []
        logits = stream.prefill(prompt)
        for _ in range(8):
            ref.append(int(np.argmax(logits)))
            logits = stream.decode(ref[-1])
        out, _, _ = collect(eng.generate(greedy("b", 8)))
        assert out == ref


@pytest.mark.parametrize("use_aio,portable", [(True, False), (False, False), (True, True)])
def test_scatter_reads_match_the_file(tmp_path, wide_model, use_aio, portable, monkeypatch):
    # (False, False): the thread-pool fallback (os.preadv scatter); portable: FLOTILLA_PORTABLE_IO=1
    # wins over aio=True -- the thread pool over lock + seek + readinto, as on Windows
    if portable:
        monkeypatch.setenv("FLOTILLA_PORTABLE_IO", "1")
    layout, w = ffn_layout(wide_model), MappedWeights(wide_model)
    build_store(w, layout, tmp_path / "s", "exact")
    for gap in (0, 2):
        store = BundleStore(tmp_path / "s", StoreConfig(max_gap=gap, aio=use_aio))
        assert (store._ring is not None) == (use_aio and not portable)
        assert store.io_reader == ("seek" if portable else "aio" if use_aio else "preadv")
        try:
            ids = np.array([0, 1, 2, 5, 9, 10, 500, 1023])
            from engine.sparse import aio

            slab = aio.aligned_empty(len(ids) * store.stride).reshape(len(ids), store.stride)
            addrs = np.uint64(slab.ctypes.data) + np.arange(len(ids), dtype=np.uint64) * np.uint64(store.stride)
            store.read_into(0, ids, addrs, slab[:, :store.payload]).wait()
            got = slab[:, :store.payload].view(np.float32).reshape(len(ids), 2, layout.hidden)
            np.testing.assert_array_equal(got[:, 0], w.numpy(layout.key(0, "up"))[ids])
            np.testing.assert_array_equal(got[:, 1], w.numpy(layout.key(0, "down"))[:, ids].T)
            assert store.stats.reads == (5 if gap == 0 else 4)  # [0-2] [5] [9-10] [500] [1023]; gap 2 joins 5..10
        finally:
            store.close()


def test_gap_rule_reads_through_only_when_cheaper_than_a_request():
    from engine.sparse.diskprobe import best_gap

    # 20k IOPS at every size and up to 1000 MB/s: one more request costs 50 us; inside a
    # merged 64 KiB request (4 bundles) one more 16 KiB bundle streams in ~25 us -> gap 1 pays
    probe = {"random": [{"size": s, "depth": 64, "iops": 20000, "mb_s": min(1000.0, 20000 * s / 1e6)}
                        for s in (4096, 16384, 262144)]}
    assert best_gap(probe, 16384) == 1
    # 60k IOPS: a request costs 17 us, less than streaming one more bundle (18 us) -> no gaps
    probe["random"] = [{"size": s, "depth": 64, "iops": 60000, "mb_s": min(900.0, 60000 * s / 1e6)}
                       for s in (4096, 16384, 262144)]
    assert best_gap(probe, 16384) == 0


@pytest.mark.parametrize("model,mode", [("wide", "exact"), ("wide", "predicted"), ("demo", "predicted")])
def test_a_layer_goes_through_in_slices_and_the_answer_stays_dense(wide_model, demo_dir, monkeypatch, model, mode):
    """A prefill chunk needs nearly every neuron of a layer; the engine gathers (and stages)
    them a slice at a time, so its working memory is a slice, not a layer (8B shapes: 64 MiB,
    not 350 MB). With slices of a few neurons, on the direct path (wide: reads land in cache
    slots) and the buffered one (demo: tiny bundles), the answer is still transformers'."""
    import engine.sparse.model as sparse_model

    monkeypatch.setattr(sparse_model, "SLICE_BYTES", 16 * 4096)  # wide exact: 16 neurons a slice
    path = wide_model if model == "wide" else demo_dir("demo")
    budget = {"exact": 5_000_000, "predicted": 10_000_000}[mode] if model == "wide" else 600_000
    cfg = SparseConfig(mode=mode, sparsity=0.0, cache_budget_bytes=budget, kv_precision="f32")  # as dense keeps KV
    with SparseEngine(path, model, cfg) as eng:
        rt = eng.runtime
        assert rt.prefetcher.direct == (model == "wide")
        assert rt.slice == max(1, sparse_model.SLICE_BYTES // rt.cache.row_bytes) < rt.layout.neurons
        sizes: list[int] = []
        plan = rt.prefetcher.plan

        def recorded(layer, need):
            for pos, rows in plan(layer, need):
                sizes.append(len(pos))
                yield pos, rows

        monkeypatch.setattr(rt.prefetcher, "plan", recorded)
        ref = reference_greedy(path, prompt_ids(eng.tokenizer, PROMPT), N)
        out, _, _ = collect(eng.generate(greedy("sliced", N)))
        assert out == ref
        assert max(sizes) <= rt.slice and len(sizes) > 2 * rt.layout.num_layers
        assert eng.stats()["io"]["bytes_read"] > 0


def test_rows_with_no_free_cache_slot_are_read_a_slice_at_a_time(wide_model, monkeypatch):
    """An active set larger than the cache (every slot busy this step) is read into a buffer
    and used without being kept: a slice at a time, the next one read while this one is used,
    so at most two slices are staged; the rows are the store's."""
    be = SparseBackend(wide_model, SparseConfig(mode="exact", sparsity=0.0, cache_budget_bytes=5_000_000))
    try:
        pf, cache, store = be.rt.prefetcher, be.rt.cache, be.rt.store
        assert pf.direct
        monkeypatch.setattr(pf, "spill_slice", 7)
        cache.tick += 1
        cache.stamp[:cache.capacity] = cache.tick  # every slot used now: nothing can be evicted
        need = np.arange(0, 60, dtype=np.int64)
        assert len(cache.missing(0, need)) == len(need)
        asked: list[int] = []
        read_async = store.read_async

        def recorded(layer, ids):
            asked.append(len(ids))
            return read_async(layer, ids)

        monkeypatch.setattr(store, "read_async", recorded)
        got = pf.rows(0, need)
        assert asked == [7] * 8 + [4]  # 60 rows, 7 at a time
        assert np.array_equal(got, store.read(0, need))
        assert not (cache.slot_of[0, need] >= 0).any()  # used, not kept
    finally:
        be.close()

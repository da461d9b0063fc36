"""The bundle store: round trip, coalescing, and a damaged file detected."""

import time

import numpy as np
import pytest

from engine.platform import read_checks

from engine.sparse.store import ALIGN, BundleStore, StoreConfig, CorruptStoreError, build_store, coalesce
from engine.sparse.weights import MappedWeights, ffn_layout


def test_coalesce_merges_small_gaps_and_splits_long_runs():
    ids = np.array([0, 1, 2, 4, 9, 10, 11, 12, 13])
    assert coalesce(ids, max_gap=1, max_run=64) == [(0, 5), (9, 14)]
    assert coalesce(ids, max_gap=0, max_run=3) == [(0, 3), (4, 5), (9, 12), (12, 14)]
    assert coalesce(np.array([], dtype=np.int64), 1, 4) == []


@pytest.mark.parametrize("mode", ["full", "exact"])
def test_bundles_hold_gate_up_down_of_each_neuron(tmp_path, demo_dir, mode):
    path = demo_dir("demo")
    layout, w = ffn_layout(path), MappedWeights(path)
    build_store(w, layout, tmp_path / "s", mode)
    store = BundleStore(tmp_path / "s", StoreConfig(max_gap=1))
    try:
        assert store.stride % ALIGN == 0
        ids = np.array([0, 3, 4, 5, 100, layout.neurons - 1])
        rows = store.read(2, ids)  # [k, P, h]
        want = {"gate": w.numpy(layout.key(2, "gate"))[ids], "up": w.numpy(layout.key(2, "up"))[ids],
                "down": w.numpy(layout.key(2, "down"))[:, ids].T}
        for j, part in enumerate(store.parts):
            np.testing.assert_array_equal(rows[:, j], want[part])
        assert store.stats.reads == 4  # runs: [0], [3..5], [100], [N-1]: one preadv each
    finally:
        store.close()


def test_damaged_bundle_file_is_detected(tmp_path, demo_dir):
    path = demo_dir("demo")
    build_store(MappedWeights(path), ffn_layout(path), tmp_path / "s", "full")
    store = BundleStore(tmp_path / "s")
    f = store.file(1)
    off = 7 * store.stride + 100
    with open(f, "r+b") as fh:  # flip one byte inside neuron 7's payload
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))
    try:
        store.read(1, np.array([3]))  # other neurons still read fine
        with pytest.raises(CorruptStoreError, match="neuron 7 fails its checksum"):
            store.read(1, np.array([6, 7, 8]))
        with pytest.raises(CorruptStoreError):
            store.verify_all()
    finally:
        store.close()
    with open(f, "r+b") as fh:  # a truncated file is refused at open
        fh.truncate(store.stride * 3)
    with pytest.raises(CorruptStoreError, match="wrong size"):
        BundleStore(tmp_path / "s")


def test_a_bundle_damaged_after_its_first_check_is_caught_on_the_next_read(tmp_path, demo_dir, monkeypatch):
    # by default a bundle is checked on its first read only -- and again once its file changed
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)  # the new store counts as settled at once
    path = demo_dir("demo")
    build_store(MappedWeights(path), ffn_layout(path), tmp_path / "s", "full")
    store = BundleStore(tmp_path / "s")
    try:
        store.read(1, np.array([6, 7]))
        store.read(1, np.array([7, 8]))
        assert store.stats.checked == 3  # 6, 7, 8: the re-read of 7 was not checked
        time.sleep(0.05)  # past the file time stamps' granularity
        off = 7 * store.stride + 100
        with open(store.file(1), "r+b") as fh:  # one byte of neuron 7 changed in place, store open
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0xFF]))
        store.read(2, np.array([7]))  # another layer's file did not change
        with pytest.raises(CorruptStoreError, match="neuron 7 fails its checksum"):
            store.read(1, np.array([7]))
    finally:
        store.close()

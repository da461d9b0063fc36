"""`--engine sparse` through the portable reader (FLOTILLA_PORTABLE_IO=1: no native AIO,
a thread pool over lock + seek + readinto, the path Windows takes) gives the same
greedy tokens as the default AIO path -- both the copy path (demo) and reads straight
into cache slots (wide model) -- and the store reports the reader it used; on a faked
Windows the store has no AIO and opens every file with FILE_FLAG_NO_BUFFERING."""

from __future__ import annotations

import ctypes
import os
import sys
import types

import numpy as np
import pytest

from engine.platform import pread
from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.local.factory import EngineOptions, open_engine
from engine.sparse import aio
from engine.sparse.engine import SparseConfig, SparseEngine
from engine.sparse.store import BundleStore, build_store
from engine.sparse.weights import MappedWeights, ffn_layout
from engine_helpers import collect

PROMPTS = ["Once upon a time there was a small robot", "The robot", "Hello there my friend"]
N = 10


def _set(monkeypatch, portable: bool) -> None:
    if portable:
        monkeypatch.setenv(pread.PORTABLE_ENV, "1")
    else:
        monkeypatch.delenv(pread.PORTABLE_ENV, raising=False)


def _tokens(eng) -> list[list[int]]:
    out = []
    for i, p in enumerate(PROMPTS):
        ids, _, final = collect(eng.generate(GenerateRequest(f"r{i}", prompt=p, sampling=SamplingParams(max_tokens=N))))
        assert final.error is None, final.error
        out.append(ids)
    return out


def _via_factory(monkeypatch, portable: bool):
    _set(monkeypatch, portable)
    eng = open_engine("demo", "sparse", EngineOptions(cache_budget_bytes=400_000,  # well below the FFN
                                                      extra={"mode": "exact", "sparsity": 0.0}))
    try:
        store = eng.runtime.store
        return _tokens(eng), eng.stats(), store.io_reader, store.io_mode, store._ring is None
    finally:
        eng.close()


def test_portable_reader_gives_the_default_tokens(demo_dir, monkeypatch):
    demo_dir("demo")
    default, d_stats, d_reader, d_mode, d_pool = _via_factory(monkeypatch, portable=False)
    forced, f_stats, f_reader, f_mode, f_pool = _via_factory(monkeypatch, portable=True)
    assert (d_reader, d_pool) == ("aio", False)
    assert (f_reader, f_pool) == ("seek", True)  # no AIO: the thread pool over the portable reader
    assert f_mode == d_mode  # unbuffered as before (o_direct on an ext4 cache): only the reader changed
    assert forced == default
    assert f_stats["io"]["bytes_read"] > 0 and f_stats["misses"] > 0


@pytest.mark.parametrize("mode", ["exact", "predicted"])
def test_portable_reader_into_cache_slots_gives_the_default_tokens(wide_model, monkeypatch, mode):
    budget = 5_000_000 if mode == "exact" else 10_000_000  # ~60 % of the FFN: streaming happens
    runs = {}
    for portable in (False, True):
        _set(monkeypatch, portable)
        cfg = SparseConfig(mode=mode, sparsity=0.0, cache_budget_bytes=budget)
        with SparseEngine(wide_model, "wide", cfg) as eng:
            assert eng.runtime.prefetcher.direct  # scatter reads straight into the cache's slots
            assert eng.runtime.store.io_reader == ("seek" if portable else "aio")
            runs[portable] = _tokens(eng)
            assert eng.stats()["io"]["bytes_read"] > 0
    assert runs[True] == runs[False]


def test_store_on_windows_reads_no_buffering_without_aio(tmp_path, demo_dir, monkeypatch):
    """A faked Windows: no native AIO; every layer file opened by CreateFileW with
    FILE_FLAG_NO_BUFFERING (stand-ins hand back O_DIRECT fds: the same alignment rules)."""
    path = demo_dir("demo")
    layout, w = ffn_layout(path), MappedWeights(path)
    build_store(w, layout, tmp_path / "s", "full")
    handles: dict[int, str] = {}

    def create_file(name, access, share, security, disposition, flags, template):
        assert flags & pread.FILE_FLAG_NO_BUFFERING
        handles[100 + len(handles)] = name
        return 99 + len(handles)

    def open_osfhandle(handle, flags):
        return os.open(handles[handle], os.O_RDONLY | os.O_DIRECT)

    monkeypatch.setattr(pread, "_windows_api", lambda: pread.WindowsAPI(
        types.SimpleNamespace(CreateFileW=create_file, CloseHandle=lambda h: 1),
        types.SimpleNamespace(open_osfhandle=open_osfhandle), lambda: 0, ctypes.c_void_p(-1).value))
    monkeypatch.setattr(sys, "platform", "win32")
    assert not aio.available()
    store = BundleStore(tmp_path / "s")
    try:
        assert sorted(handles.values()) == [str(store.file(i)) for i in range(layout.num_layers)]
        assert store._ring is None and store.io_reader == "seek"
        assert store.io_info() == {"requested": "no_buffering", "effective": "no_buffering", "fallback_reason": None}
        ids = np.array([0, 3, 4, 5, 100, layout.neurons - 1])
        rows = store.read(2, ids)  # checksummed on the way in
        np.testing.assert_array_equal(rows[:, 1], w.numpy(layout.key(2, "up"))[ids])
    finally:
        store.close()

"""`--engine moe` through the portable reader (FLOTILLA_PORTABLE_IO=1: the lock + seek +
readinto path Windows takes) gives the same greedy tokens as the default os.preadv
path, and the store says which reader and which unbuffered mode it used; on a faked
Windows the store opens with FILE_FLAG_NO_BUFFERING and reports it."""

from __future__ import annotations

import ctypes
import os
import sys
import types

import numpy as np

from engine.moe.store import ExpertStore
from engine.platform.pread import aligned_buffer
from engine.platform import pread
from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.local.factory import EngineOptions, open_engine
from engine_helpers import collect

PROMPTS = ["Once upon a time", "The robot", "Hello there my friend"]
N = 8


def _greedy(monkeypatch, portable: bool) -> tuple[list[list[int]], dict, str, str]:
    """(tokens per prompt, stats, the store's io_reader, io_mode) of demo-moe with a cache
    of 3 experts, so experts are read from disk while generating."""
    if portable:
        monkeypatch.setenv(pread.PORTABLE_ENV, "1")
    else:
        monkeypatch.delenv(pread.PORTABLE_ENV, raising=False)
    from engine.models.demo import ensure_demo
    from engine.models.ref import resolve_model
    from engine.moe.convert import ensure_store

    path = ensure_demo("demo-moe")
    blob = ExpertStore(ensure_store(path, resolve_model(str(path)).fingerprint)).index.blob_bytes
    eng = open_engine("demo-moe", "moe", EngineOptions(cache_budget_bytes=3 * blob, extra={"fetch_threads": 2}))
    try:
        out = []
        for i, p in enumerate(PROMPTS):
            ids, _, final = collect(eng.generate(GenerateRequest(f"r{i}", prompt=p,
                                                                 sampling=SamplingParams(max_tokens=N,
                                                                                         ignore_eos=True))))
            assert final.error is None, final.error
            out.append(ids)
        return out, eng.stats(), eng.store.io_reader, eng.store.io_mode
    finally:
        eng.close()


def test_portable_reader_gives_the_default_tokens(monkeypatch):
    default, d_stats, d_reader, d_mode = _greedy(monkeypatch, portable=False)
    forced, f_stats, f_reader, f_mode = _greedy(monkeypatch, portable=True)
    assert (d_reader, f_reader) == ("preadv", "seek")
    assert f_mode == d_mode  # unbuffered as before (o_direct on an ext4 cache): only the reader changed
    assert forced == default
    assert all(len(t) == N for t in forced)
    assert f_stats["bytes_read"] > 0 and f_stats["blobs_read"] >= d_stats["blobs_read"] > 0


def test_store_on_windows_opens_no_buffering(moe_model, monkeypatch):
    """A faked Windows: kernel32/msvcrt stand-ins hand back an O_DIRECT fd (the same
    alignment rules as FILE_FLAG_NO_BUFFERING); the store reads by seek and says so."""
    _path, store_dir = moe_model("qwen2_moe")
    want = ExpertStore(store_dir)
    calls = []

    def create_file(*args):
        calls.append(("CreateFileW", args[5]))
        return 0x44

    def open_osfhandle(handle, flags):
        calls.append(("open_osfhandle", handle))
        return os.open(store_dir / "experts.bin", os.O_RDONLY | os.O_DIRECT)

    monkeypatch.setattr(pread, "_windows_api", lambda: pread.WindowsAPI(
        types.SimpleNamespace(CreateFileW=create_file, CloseHandle=lambda h: 1),
        types.SimpleNamespace(open_osfhandle=open_osfhandle), lambda: 0, ctypes.c_void_p(-1).value))
    monkeypatch.setattr(sys, "platform", "win32")
    store = ExpertStore(store_dir)
    try:
        assert store.io_info() == {"requested": "no_buffering", "effective": "no_buffering", "fallback_reason": None}
        assert store.io_reader == "seek" and store.direct
        assert calls == [("CreateFileW", pread.FILE_ATTRIBUTE_NORMAL | pread.FILE_FLAG_NO_BUFFERING),
                         ("open_osfhandle", 0x44)]
        for key in store.keys[::3]:
            a, b = aligned_buffer(store.index.blob_bytes), aligned_buffer(store.index.blob_bytes)
            store.read_into(key, a)  # checksummed: the right bytes
            want.read_into(key, b)
            assert np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
    finally:
        store.close()
        want.close()

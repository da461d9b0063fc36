"""The fetcher's idle-fill reads (the bevy_guess ablation's guesses): the disk reads them
only when no request waits for an expert, one at a time, a newer guess replaces the queued
ones, and a guess nobody used is counted as bytes read in vain. And its idle time, by what
the scheduler was doing meanwhile (the gaps bench moe reports)."""

from __future__ import annotations

import threading
import time

from engine.moe.cache import ExpertCache
from engine.moe.fetcher import Fetcher
from engine.moe.store import ExpertStore


class GatedStore:
    """An expert store whose reads start at once but finish only when the test says."""

    def __init__(self, store: ExpertStore) -> None:
        self.store, self.index = store, store.index
        self.started: list = []
        self.gate = threading.Event()
        self._lock = threading.Lock()

    def read_into(self, key, buf) -> None:
        with self._lock:
            self.started.append(key)
        assert self.gate.wait(30), "the test never opened the gate"
        self.store.read_into(key, buf)


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _gated(moe_model, threads: int) -> tuple[GatedStore, ExpertCache, Fetcher]:
    _path, store_dir = moe_model("mixtral")
    store = GatedStore(ExpertStore(store_dir))
    cache = ExpertCache(store.index, 8 * store.index.blob_bytes)
    return store, cache, Fetcher(store, cache, threads=threads)


def _settle() -> None:
    time.sleep(0.2)  # long enough for an idle fetch thread to pick up anything it was allowed to


def test_guesses_are_read_one_at_a_time_and_never_keep_a_real_miss_waiting(moe_model):
    store, cache, fetcher = _gated(moe_model, threads=3)
    try:
        likely, unlikely, miss = (1, 0), (1, 1), (0, 2)
        fetcher.request(unlikely, priority=-0.5, hold=False)
        fetcher.request(likely, priority=-0.2, hold=False)
        _wait_for(lambda: store.started)
        _settle()
        assert store.started == [likely]  # the likeliest first, and only one of them with 3 threads free
        assert fetcher.idle()  # guesses alone: the disk has nothing a request waits for
        assert fetcher.request(miss, priority=1.0, hold=True)
        _wait_for(lambda: miss in store.started)  # a free thread takes it at once
        assert not fetcher.idle()
        store.gate.set()
        _wait_for(lambda: all(cache.resident(k) for k in (likely, unlikely, miss)))
        assert fetcher.take_arrived(wait_s=1.0) == [miss]  # guesses land unheld, unreported
        assert fetcher.stats.fills == 2 and fetcher.stats.fetched == 3
    finally:
        store.gate.set()
        fetcher.close()


def test_a_newer_guess_replaces_the_queued_ones_but_not_what_a_request_asked_for(moe_model):
    store, cache, fetcher = _gated(moe_model, threads=1)
    try:
        busy, stale, asked = (0, 0), (1, 0), (1, 1)
        fetcher.request(busy, priority=1.0, hold=True)  # the only thread is busy with it
        _wait_for(lambda: store.started == [busy])
        fetcher.request(stale, priority=-0.5, hold=False)
        fetcher.request(asked, priority=-0.5, hold=False)
        assert fetcher.request(asked, priority=2.0, hold=True)  # a request now waits for it
        fetcher.drop_fills()
        store.gate.set()
        _wait_for(lambda: cache.resident(asked))
        _settle()
        assert store.started == [busy, asked] and not cache.resident(stale)
        arrived = set(fetcher.take_arrived(wait_s=1.0))
        assert arrived == {busy, asked}
    finally:
        store.gate.set()
        fetcher.close()


def test_a_guess_evicted_before_any_request_used_it_is_counted(moe_model):
    _path, store_dir = moe_model("mixtral")
    store = ExpertStore(store_dir)
    cache = ExpertCache(store.index, 2 * store.index.blob_bytes)
    used, wasted = (0, 0), (0, 1)
    for key in (used, wasted):
        slot = cache.reserve(timeout=0)
        store.read_into(key, cache.buffer(slot))
        cache.commit(slot, key, pins=0, guess=True)
    assert cache.guessed_unused() == 2
    assert cache.pin(used) is not None  # a request uses it
    cache.unpin(used)
    assert cache.guessed_unused() == 1
    cache.demand(used)  # the used one is the hotter: the unused guess goes first
    slot = cache.reserve(timeout=0)
    assert not cache.resident(wasted) and cache.resident(used)
    assert cache.stats.inserts == 2 and cache.stats.unasked_unused == 1 and cache.guessed_unused() == 1
    cache.release(slot)


def _answers(store_dir, scheduler: str):
    from engine.moe.engine import MoEConfig, MoEEngine
    from engine.protocol.messages import GenerateRequest, SamplingParams

    index = ExpertStore(store_dir).index
    cfg = MoEConfig(scheduler=scheduler, cache_budget_bytes=2 * index.top_k * index.blob_bytes,
                    fetch_threads=2, torch_threads=1, kv_precision="f32", max_concurrent=8)
    with MoEEngine(store_dir, "t", cfg) as eng:
        ids = [eng.submit(GenerateRequest(f"r{i}", prompt=f"Request {i} asks about", sampling=SamplingParams(
            max_tokens=6))) for i in range(8)]
        answers = []
        for rid in ids:
            events = list(eng.stream(rid, timeout=120))
            assert events[-1].error is None, events[-1].error
            answers.append([t for e in events for t in e.token_ids])
        return answers, eng.stats()


def test_bevy_guess_reads_guesses_and_answers_as_bevy(moe_model):
    _path, store_dir = moe_model("olmoe")
    guessing, stats = _answers(store_dir, "bevy_guess")
    plain, plain_stats = _answers(store_dir, "bevy")
    assert guessing == plain  # f32: a guess changes what is read when, never what is computed
    assert stats["guess_reads"] > 0 and plain_stats["guess_reads"] == 0
    assert 0 <= stats["unused_bytes"] <= stats["bytes_read"]


def test_idle_time_goes_to_the_phase_the_scheduler_was_in_and_a_read_in_flight_is_not_idle(moe_model):
    store, cache, fetcher = _gated(moe_model, threads=2)
    try:
        fetcher.phase("head")
        time.sleep(0.3)  # nothing to read: all of it idle, in the head
        fetcher.phase("experts")
        fetcher.request((0, 0), priority=1.0, hold=True)
        fetcher.request((1, 0), priority=-0.5, hold=False)  # a guess: does not make the disk busy
        _wait_for(lambda: len(store.started) == 2)
        time.sleep(0.3)  # a request's read in flight: busy
        store.gate.set()
        _wait_for(lambda: fetcher.take_arrived(wait_s=0.1) == [(0, 0)])
        idle = fetcher.idle_by_phase()
        assert idle["head"] >= 0.25
        assert idle.get("experts", 0.0) < 0.2  # only the moments around the read, not its 0.3 s
        assert set(idle) <= {"engine", "head", "experts"}
    finally:
        store.gate.set()
        fetcher.close()


def test_the_disk_s_busy_time_counts_a_read_still_in_flight(moe_model):
    store, cache, fetcher = _gated(moe_model, threads=1)
    try:
        fetcher.request((0, 0), priority=1.0, hold=True)
        _wait_for(lambda: store.started == [(0, 0)])
        time.sleep(0.3)
        assert fetcher.stats.busy_s == 0.0  # no stretch of reads has closed yet
        assert fetcher.busy_time() >= 0.25  # Bevy's choice of waves reads this one
        store.gate.set()
        _wait_for(lambda: fetcher.take_arrived(wait_s=0.1) == [(0, 0)])
        assert fetcher.stats.busy_s >= 0.25 and abs(fetcher.busy_time() - fetcher.stats.busy_s) < 1e-9
    finally:
        store.gate.set()
        fetcher.close()


def test_an_engine_reports_the_disks_idle_time_by_scheduler_phase(moe_model):
    from engine.moe.scheduler import PHASES

    _path, store_dir = moe_model("olmoe")
    _answers_, stats = _answers(store_dir, "bevy")
    idle = stats["disk_idle_s"]
    assert set(idle) <= set(PHASES)
    # a small store is mostly resident: the disk idles through every step of a pass
    assert all(idle.get(p, 0.0) > 0 for p in ("attention", "experts", "head", "sampling"))

"""memory_room: what this process may still take under its memory cgroup (v1 and v2, faked here as
files), clean unmapped page cache counted as free, no limit -> None; settle_heap's freeze."""

from __future__ import annotations

from engine.platform.memory import cgroup_room

MB = 2**20


def _v1(tmp_path, limit: int, usage: int, **stat: int):
    group = tmp_path / "memory" / "flotilla-x"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    (group / "memory.usage_in_bytes").write_text(str(usage))
    (group / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))
    proc = tmp_path / "cgroup"
    proc.write_text("12:cpu,cpuacct:/\n5:memory:/flotilla-x\n")
    return proc


def test_v1_room_counts_clean_unmapped_page_cache(tmp_path):
    proc = _v1(tmp_path, 1000 * MB, 900 * MB, total_cache=300 * MB, total_mapped_file=40 * MB,
               total_dirty=10 * MB, total_writeback=0)
    assert cgroup_room(proc, tmp_path) == (100 + 300 - 40 - 10) * MB


def test_v1_without_a_limit_is_none(tmp_path):
    proc = _v1(tmp_path, 9223372036854771712, 5 * MB, total_cache=0)
    assert cgroup_room(proc, tmp_path) is None


def test_v2_room(tmp_path):
    group = tmp_path / "user.slice"
    group.mkdir()
    (group / "memory.max").write_text(str(2000 * MB))
    (group / "memory.current").write_text(str(1500 * MB))
    (group / "memory.stat").write_text(f"anon {1000 * MB}\nfile {500 * MB}\nfile_mapped {100 * MB}\n"
                                       f"file_dirty 0\nfile_writeback 0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice\n")
    assert cgroup_room(proc, tmp_path) == (500 + 400) * MB
    (group / "memory.max").write_text("max\n")
    assert cgroup_room(proc, tmp_path) is None


def test_no_cgroup_file_is_none(tmp_path):
    assert cgroup_room(tmp_path / "missing", tmp_path) is None


def test_settle_heap_freezes_what_lives_and_frees_what_an_earlier_call_froze():
    """A served engine's heap is frozen (no full collection walks it mid-answer); an engine
    closed since the last settle is not kept by the freeze: its cycles go at the next one."""
    import gc
    import weakref

    from engine.platform.memory import settle_heap

    class Engine:  # stands for a loaded engine: objects in a reference cycle
        pass

    def cycle():
        a, b = Engine(), Engine()
        a.other, b.other = b, a
        return a

    garbage = cycle()
    gone_before = weakref.ref(garbage)
    del garbage  # unreachable already: collected by this settle, not frozen
    first = cycle()
    first_alive = weakref.ref(first)
    try:
        settle_heap()
        assert gone_before() is None
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert first_alive() is not None  # alive and frozen
        del first  # "closed" while frozen: no collection reaches it ...
        gc.collect()
        assert first_alive() is not None
        settle_heap()  # ... until the next settle unfreezes and collects
        assert first_alive() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual


def test_settled_heap_freezes_for_the_run_and_lets_its_engine_go_after():
    """A benchmark's run measures a settled heap, as chat and serve run; once it ended, the
    engine it closed is collectable again (a test session or bench process does not keep it)."""
    import gc
    import weakref

    from engine.platform.memory import settled_heap

    class Engine:
        pass

    engine = Engine()
    engine.me = engine  # a reference cycle, as a loaded engine holds
    alive = weakref.ref(engine)
    try:
        with settled_heap():
            assert gc.get_freeze_count() > 0
            del engine  # closed during the run: frozen, no collection reaches it yet
            gc.collect()
            assert alive() is not None
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()

"""app/gui_gc.py: reference cycles holding Qt objects are collected on the GUI thread, never
on a worker thread that happens to allocate."""

from __future__ import annotations

import gc
import threading
import weakref

from PySide6.QtCore import QObject

from app.gui_gc import GuiThreadCollector


def _dropped_cycle() -> weakref.ref:
    """A QObject in a reference cycle (as a widget and a lambda connected to it), dropped."""
    obj = QObject()
    obj.me = obj  # the cycle: reference counting alone never frees it
    ref = weakref.ref(obj)
    del obj
    return ref


def test_cycles_wait_for_the_gui_thread_and_go_there(qapp):
    before = gc.isenabled()  # off already under the app tests' own collector (conftest)
    gc.enable()
    collector = GuiThreadCollector()
    collector.start()
    try:
        assert not gc.isenabled()
        ref = _dropped_cycle()

        kept: list = []

        def allocate() -> None:  # far past the youngest generation's threshold, on a worker thread
            for _ in range(50_000):
                kept.append([])

        worker = threading.Thread(target=allocate)
        worker.start()
        worker.join()
        assert ref() is not None  # the worker's allocations collected nothing
        assert collector.check() > 0  # a threshold passed: the timer's check collects...
        assert ref() is None  # ...here, on the GUI thread
        kept.clear()
    finally:
        collector.stop()
    try:
        assert gc.isenabled()  # automatic collection given back
    finally:
        (gc.enable if before else gc.disable)()


def test_stop_collects_what_is_left_and_keeps_collection_off_if_it_was(qapp):
    before = gc.isenabled()
    gc.disable()
    try:
        collector = GuiThreadCollector()
        collector.start()
        ref = _dropped_cycle()
        collector.stop()
        assert ref() is None and not gc.isenabled()
    finally:
        (gc.enable if before else gc.disable)()

"""The one sanctioned way to run work off the GUI thread.

Every engine call the app makes (open, submit + stream, cancel, close, even
listing demo models) goes through a Runner. A Runner starts a job on its own
QThreadPool and hands back a Task: a QObject living on the GUI thread whose
public signals always fire on the GUI thread, in order:

    item(obj)*  then  result(obj) | failed(exc)  then  finished()

Why the private-signal relay: the worker thread emits private signals that are
connected to the Task's own slots with an explicit QueuedConnection. The Task
lives on the GUI thread, so those slots run there and re-emit the public
signals; whatever a caller connects (bound methods, lambdas, partials) then
runs on the GUI thread too. Relying on AutoConnection with a lambda receiver is
the classic PySide pitfall where the slot silently runs in the worker thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from typing import Any

from PySide6.QtCore import QObject, QRunnable, QThread, QThreadPool, Qt, Signal, Slot


class Task(QObject):
    """A handle on one background job. Connect before the event loop runs
    again (signals are queued, so connecting right after call() is safe)."""

    item = Signal(object)  # a yielded element, or a report() from the job
    result = Signal(object)  # the return value of a call() job
    failed = Signal(object)  # the exception the job raised
    finished = Signal()  # always, exactly once, last

    # Emitted from the worker thread; relayed to the public signals above.
    _item = Signal(object)
    _batch = Signal()  # elements are waiting in _pending (one signal per burst)
    _result = Signal(object)
    _failed = Signal(object)
    _finished = Signal()

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name  # for error messages and debugging
        self._stop = threading.Event()
        self.done = False  # set on the GUI thread once finished() fired
        queued = Qt.ConnectionType.QueuedConnection
        self._item.connect(self._on_item, queued)
        self._batch.connect(self._on_batch, queued)
        self._pending: collections.deque = collections.deque()
        self._pending_lock = threading.Lock()
        self._result.connect(self._on_result, queued)
        self._failed.connect(self._on_failed, queued)
        self._finished.connect(self._on_finished, queued)

    # -- usable from any thread ----------------------------------------------
    def report(self, value: Any) -> None:
        """Send a progress value to the GUI thread (arrives as item)."""
        self._item.emit(value)

    def push(self, value: Any) -> None:
        """Queue an element for the GUI thread (iterate jobs). A burst of
        elements (tokens arrive hundreds a second) crosses to the GUI thread as
        one queued call, not one each: fewer GIL hand-offs and event-loop
        wake-ups, so the GUI thread does less while a stream runs at full speed.
        Elements still arrive one item() each, in order, before result()."""
        with self._pending_lock:
            self._pending.append(value)
            first = len(self._pending) == 1
        if first:
            self._batch.emit()

    def request_stop(self) -> None:
        """Ask an iterate() job to stop after the element it is waiting for.
        It cannot interrupt a blocking call; cancel the engine request for that."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    # -- GUI-thread relays -----------------------------------------------------
    @Slot(object)
    def _on_item(self, value: object) -> None:
        self.item.emit(value)

    @Slot()
    def _on_batch(self) -> None:
        with self._pending_lock:
            values = list(self._pending)
            self._pending.clear()
        for value in values:
            self.item.emit(value)

    @Slot(object)
    def _on_result(self, value: object) -> None:
        self.result.emit(value)

    @Slot(object)
    def _on_failed(self, exc: object) -> None:
        self.failed.emit(exc)

    @Slot()
    def _on_finished(self) -> None:
        self.done = True
        self.finished.emit()


class _Job(QRunnable):
    """Runs in a pool thread; talks to the GUI only through the Task's signals."""

    def __init__(self, task: Task, fn: Callable[[], Any], iterate: bool) -> None:
        super().__init__()
        self.setAutoDelete(True)
        self._task = task
        self._fn = fn
        self._iterate = iterate

    def run(self) -> None:
        task = self._task
        try:
            out = self._fn()
            if self._iterate:
                for value in out:
                    task.push(value)
                    if task.stop_requested:
                        break
                task._result.emit(None)
            else:
                task._result.emit(out)
        except BaseException as exc:  # noqa: BLE001 - the GUI decides what to show
            task._failed.emit(exc)
        finally:
            task._finished.emit()


class Runner(QObject):
    """Starts jobs on a private thread pool and keeps their Tasks alive until
    they finish (a Task collected mid-job would drop its signals)."""

    idle = Signal()  # the last running job has finished (shutdown waits on it)

    def __init__(self, parent: QObject | None = None, max_threads: int = 4) -> None:
        super().__init__(parent)
        self._pool = QThreadPool(self)
        # A stream holds a thread for a whole answer; leave room for the
        # cancel/close calls that must run beside it.
        self._pool.setMaxThreadCount(max_threads)
        self._tasks: set[Task] = set()

    def call(self, fn: Callable[..., Any], *args: Any, report_to: str | None = None,
             name: str | None = None, **kwargs: Any) -> Task:
        """Run fn(*args, **kwargs) in a worker; its return value arrives as result.
        With report_to="progress", fn gets progress=<callable> whose calls
        (from the worker) arrive as item(args-tuple) on the GUI thread."""
        task = self._new_task(name or getattr(fn, "__name__", "call"))
        if report_to is not None:
            kwargs[report_to] = lambda *values: task.report(values)
        return self._start(task, lambda: fn(*args, **kwargs), iterate=False)

    def iterate(self, fn: Callable[..., Iterable[Any]], *args: Any,
                name: str | None = None, **kwargs: Any) -> Task:
        """Call fn(*args, **kwargs) in a worker and deliver each element it
        yields as item; result(None) once it is exhausted."""
        task = self._new_task(name or getattr(fn, "__name__", "iterate"))
        return self._start(task, lambda: fn(*args, **kwargs), iterate=True)

    def active(self) -> int:
        return len(self._tasks)

    def wait_for_done(self, timeout_ms: int = 5000) -> bool:
        """Block until every job has returned (shutdown only)."""
        return self._pool.waitForDone(timeout_ms)

    # -- internals -------------------------------------------------------------
    def _new_task(self, name: str) -> Task:
        # Tasks must live on the GUI thread so their relay slots run there.
        assert QThread.currentThread() is self.thread(), "start background jobs from the GUI thread"
        task = Task(name, self)
        self._tasks.add(task)
        task.finished.connect(lambda: self._forget(task))
        return task

    def _start(self, task: Task, fn: Callable[[], Any], iterate: bool) -> Task:
        self._pool.start(_Job(task, fn, iterate))
        return task

    def _forget(self, task: Task) -> None:
        self._tasks.discard(task)
        task.deleteLater()
        if not self._tasks:
            self.idle.emit()

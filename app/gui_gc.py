"""Python's cyclic garbage collector, run on the GUI thread only.

Python collects reference cycles in whichever thread happens to allocate when a generation
fills up: with the app's background jobs (app/background.py), often a worker thread. A Qt
object held in a cycle (a widget, a Task and the lambdas connected to it) is then destroyed
on that thread. Qt objects are not thread-safe: the GUI thread may go on to touch one being
destroyed, and the process dies in Qt's event loop. The test suite once crashed that way,
in the GUI thread's event loop while a worker walked a model folder.

So while the app runs, automatic collection is off, and a timer on the GUI thread collects
instead, each generation when its threshold says so (Anki does the same, for the same
reason). Objects without cycles are still freed at once by reference counting.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer


class GuiThreadCollector(QObject):
    """Cyclic garbage collection on the thread this object lives on (the GUI thread)."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = 1000) -> None:
        super().__init__(parent)
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.check)
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        """Turn automatic collection off and collect on the timer instead."""
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._timer.start()

    def stop(self) -> None:
        """Collect what is left, here, and give automatic collection back as it was."""
        self._timer.stop()
        gc.collect()
        if self._was_enabled:
            gc.enable()

    def check(self) -> int:
        """Collect the oldest generation whose count passed its threshold (what automatic
        collection would have done by now); returns the objects found unreachable."""
        counts, limits = gc.get_count(), gc.get_threshold()
        due = [g for g in range(3) if counts[g] > limits[g]]
        return gc.collect(max(due)) if due else 0

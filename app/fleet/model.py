"""The live fleet the app knows: peers found over mDNS and peers added by
address, each with its pairing state. One per window, shared by the Fleet view
(cards) and the Plan editor (which plans and launches on them).

Discovery runs in engine.client.FleetWatcher on the Runner (an iterate job
that lives as long as the window): its changes arrive here on the GUI thread
as items. Interfaces come from Settings ("" = all interfaces, what real users
want; the tests use 127.0.0.1 so nothing leaves the machine).
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal

from app.background import Runner, Task
from engine import client


class FleetModel(QObject):
    changed = Signal()  # cards, manual entries or the discovery status changed

    def __init__(self, runner: Runner, interfaces: str = "", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.runner = runner
        self.cards: dict[str, client.PeerCard] = {}  # node id -> card (discovered and manual peers)
        self.entries: list[str] = []  # peers added by address ("host:port")
        self.status = "starting discovery…"  # what is being watched, or why not
        self.error = ""  # the discovery could not start: why
        self.watcher: client.FleetWatcher | None = None
        self._stop: threading.Event | None = None
        self._task: Task | None = None
        self.interfaces = interfaces
        self.launch_ok, self.launch_reason = False, "checking the fleet launcher…"
        task = runner.call(client.fleet_launch_available, name="fleet-launcher")
        task.result.connect(self._on_launcher)
        self._load_entries()

    # -- discovery --------------------------------------------------------------------
    def start(self, interfaces: str | None = None) -> None:
        """(Re)start discovery on `interfaces` ("" = all, else comma-separated names/addresses)."""
        if interfaces is not None:
            self.interfaces = interfaces
        self.stop()
        chosen = [i.strip() for i in self.interfaces.split(",") if i.strip()] or None
        self.watcher = watcher = client.FleetWatcher(chosen)
        self._stop = stop = threading.Event()
        self.cards.clear()
        self.error = ""
        self.status = "starting discovery…"
        self._task = task = self.runner.iterate(watcher.events, stop, name="fleet-watch")
        task.item.connect(lambda ch, w=watcher: self._on_change(w, ch))
        task.failed.connect(lambda exc: self._failed(str(exc)))
        self.changed.emit()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()  # the watcher job ends within ~0.2 s
        self._stop = self._task = None
        self.watcher = None

    def _on_change(self, watcher: client.FleetWatcher, ch: client.FleetChange) -> None:
        if watcher is not self.watcher:
            return  # a stopped watcher's last events
        if ch.kind == "ready":
            self.status = f"Looking for agents ({ch.message}) and polling the peers added by address"
        elif ch.kind == "error":
            self._failed(ch.message)
            return
        elif ch.kind == "removed" and ch.card is not None:
            self.cards.pop(ch.card.peer_id, None)
        elif ch.card is not None:
            self.cards[ch.card.peer_id] = ch.card
        self.changed.emit()

    def _failed(self, reason: str) -> None:
        self.error = reason
        self.status = f"Discovery stopped: {reason}"
        self.changed.emit()

    def _on_launcher(self, res: tuple) -> None:
        self.launch_ok, self.launch_reason = res
        self.changed.emit()

    # -- peers by address ----------------------------------------------------------
    def _load_entries(self) -> None:
        task = self.runner.call(client.peer_addresses, name="peer-addresses")
        task.result.connect(self._set_entries)

    def _set_entries(self, entries: list) -> None:
        self.entries = list(entries)
        self.changed.emit()

    def add_address(self, text: str) -> Task:
        """Remember host[:port] and poll it; the task fails with ValueError for a bad address."""
        watcher = self.watcher
        task = self.runner.call(watcher.add_address if watcher else client.add_peer_address, text,
                                name="add-peer")
        task.result.connect(lambda entry: entry in self.entries or self._set_entries([*self.entries, entry]))
        return task

    def remove_address(self, entry: str) -> Task:
        watcher = self.watcher
        task = self.runner.call(watcher.remove_address if watcher else client.remove_peer_address, entry,
                                name="remove-peer")
        task.finished.connect(self._load_entries)
        self.cards = {k: c for k, c in self.cards.items() if not (c.source == "manual" and c.address == entry)}
        self.entries = [e for e in self.entries if e != entry]
        self.changed.emit()
        return task

    def refresh(self, card: client.PeerCard) -> None:
        """Ask a peer again now (after pairing)."""
        if self.watcher is not None:
            self.runner.call(self.watcher.refresh, card, name="fleet-refresh")

    # -- reading ---------------------------------------------------------------------
    def peers(self) -> list[client.PeerCard]:
        """Live peers, by name."""
        return sorted(self.cards.values(), key=lambda c: (c.name.lower(), c.peer_id))

    def silent_entries(self) -> list[str]:
        """Peers added by address that have not answered (yet)."""
        live = {c.address for c in self.cards.values()}
        return [e for e in self.entries if e not in live]

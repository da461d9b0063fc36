"""The Fleet view: a live card per peer and the running pipeline ring.

Peers come from engine.client.fleet_snapshot(), refreshed in the background
every few seconds while the view is shown. Today that is this PC plus the
peers added by address (asked for their info; an unanswered one is shown
greyed out with the reason). When the fleet controller lands, discovered and
paired peers arrive through the same function as more cards: nothing here
changes but the Discover and Pair buttons getting enabled.
"""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFrame, QGridLayout, QHBoxLayout, QLabel, QLineEdit, QProgressBar, QPushButton, QScrollArea,
    QVBoxLayout, QWidget,
)

from app.background import Runner
from app.ring_view import RingView
from app.session import EngineSession
from engine import client

REFRESH_MS = 4000  # peers
RING_MS = 1000  # ring timings


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _since(t: float | None) -> str:
    if t is None:
        return "unknown"
    mins = max(0, int((time.time() - t) / 60))
    if mins < 1:
        return "active now"
    return f"idle {mins} min" if mins < 120 else f"idle {mins // 60} h"


class PeerCardWidget(QFrame):
    def __init__(self, card: client.PeerCard, pairing_reason: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("card")
        self.card = card
        self.setMinimumWidth(300)
        self.setMaximumWidth(440)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 12, 14, 12)
        name = QLabel(card.name, objectName="section")
        name.setWordWrap(True)
        lay.addWidget(name)
        meta = [card.os or "OS unknown"]
        if card.local:
            meta.append("this PC")
        else:
            meta.append("paired" if card.paired else "not paired")
        lay.addWidget(QLabel(" · ".join(meta), objectName="muted"))
        if card.devices:
            devs = ", ".join(f"{d} ({full})" if full else d
                             for d, full in zip(card.devices, card.device_names or ("",) * len(card.devices)))
            dl = QLabel(f"Devices: {devs}")
            dl.setWordWrap(True)
            lay.addWidget(dl)
        if card.ram_total:
            used = card.ram_total - card.ram_free
            bar = QProgressBar()
            bar.setRange(0, 1000)
            bar.setValue(int(1000 * used / card.ram_total))
            bar.setTextVisible(False)
            bar.setAccessibleName(f"RAM {_gb(card.ram_free)} free of {_gb(card.ram_total)}")
            lay.addWidget(QLabel(f"RAM: {_gb(card.ram_free)} free of {_gb(card.ram_total)}"))
            lay.addWidget(bar)
        if card.reachable:
            lay.addWidget(QLabel(f"User: {_since(card.idle_since)} · {card.sharing}"))
        if card.reason:
            why = QLabel(card.reason, objectName="muted" if card.reachable else "error")
            why.setWordWrap(True)
            lay.addWidget(why)
        row = QHBoxLayout()
        if not card.local:
            pair = QPushButton("Pair…")
            pair.setEnabled(False)
            pair.setToolTip(pairing_reason)
            self.remove_button = QPushButton("Remove")
            row.addWidget(pair)
            row.addWidget(self.remove_button)
        row.addStretch(1)
        lay.addLayout(row)
        lay.addStretch(1)
        # An unreachable peer is greyed out, but its Remove button still works.
        self.usable = card.reachable
        if not card.reachable:
            for i in range(lay.count()):
                w = lay.itemAt(i).widget()
                if w is not None and w.objectName() != "error":
                    w.setEnabled(False)


class FleetView(QWidget):
    def __init__(self, session: EngineSession, runner: Runner, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session, self.runner = session, runner
        self.snapshot: client.FleetSnapshot | None = None
        self.cards: list[PeerCardWidget] = []
        self._busy = False

        root = QVBoxLayout(self)
        root.setContentsMargins(24, 18, 24, 18)
        head = QHBoxLayout()
        head.addWidget(QLabel("Fleet", objectName="title"))
        head.addStretch(1)
        self.address = QLineEdit()
        self.address.setPlaceholderText("Add a peer by address: host or host:port")
        self.address.setAccessibleName("Peer address")
        self.address.setMinimumWidth(260)
        self.address.returnPressed.connect(self.add_peer)
        self.add_button = QPushButton("Add peer")
        self.add_button.clicked.connect(self.add_peer)
        self.discover_button = QPushButton("Discover peers")
        self.discover_button.setEnabled(False)
        head.addWidget(self.address)
        head.addWidget(self.add_button)
        head.addWidget(self.discover_button)
        root.addLayout(head)
        self.notice = QLabel("", objectName="muted")
        self.notice.setWordWrap(True)
        root.addWidget(self.notice)

        self.grid_host = QWidget()
        self.grid = QGridLayout(self.grid_host)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSpacing(12)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.grid_host)
        scroll.setMinimumHeight(200)
        root.addWidget(scroll, 2)

        root.addWidget(QLabel("Running pipeline", objectName="section"))
        self.ring = RingView()
        root.addWidget(self.ring, 3)

        self._timer = QTimer(self, interval=REFRESH_MS)
        self._timer.timeout.connect(self.refresh)
        self._ring_timer = QTimer(self, interval=RING_MS)
        self._ring_timer.timeout.connect(self.refresh_ring)
        session.changed.connect(self.refresh_ring)
        self.setTabOrder(self.address, self.add_button)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().showEvent(event)
        self.refresh()
        self.refresh_ring()
        self._timer.start()
        self._ring_timer.start()

    def hideEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().hideEvent(event)
        self._timer.stop()
        self._ring_timer.stop()

    # -- peers --------------------------------------------------------------------------
    def refresh(self) -> None:
        if self._busy:
            return
        self._busy = True
        task = self.runner.call(client.fleet_snapshot, name="fleet")
        task.result.connect(self._show)
        task.failed.connect(lambda exc: self.notice.setText(f"Cannot read this PC: {exc}"))
        task.finished.connect(lambda: setattr(self, "_busy", False))

    def _show(self, snap: client.FleetSnapshot) -> None:
        self.snapshot = snap
        self.discover_button.setToolTip(snap.discovery_reason)
        self.notice.setText(f"Discover peers is not available yet: {snap.discovery_reason}.")
        for w in self.cards:
            w.setParent(None)
            w.deleteLater()
        self.cards = []
        cols = max(1, min(3, self.width() // 450))
        for i, card in enumerate(snap.peers):
            w = PeerCardWidget(card, snap.pairing_reason)
            if not card.local:
                w.remove_button.clicked.connect(lambda _=False, a=card.address: self.remove_peer(a))
            self.grid.addWidget(w, i // cols, i % cols, Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
            self.cards.append(w)

    def add_peer(self) -> None:
        text = self.address.text().strip()
        if not text:
            return
        task = self.runner.call(client.add_peer_address, text, name="add-peer")
        task.result.connect(lambda entry: (self.address.clear(),
                                           self.notice.setText(f"Added {entry}; asking it for its info…"),
                                           self.refresh()))
        task.failed.connect(lambda exc: self.notice.setText(f"Cannot add “{text}”: {exc}"))

    def remove_peer(self, entry: str) -> None:
        task = self.runner.call(client.remove_peer_address, entry, name="remove-peer")
        task.finished.connect(self.refresh)

    # -- ring ---------------------------------------------------------------------------
    def refresh_ring(self) -> None:
        engine = self.session.engine
        if engine is None or self.session.kind != "pipeline":
            self.ring.set_snapshot(None)
            return
        task = self.runner.call(client.ring_snapshot, engine, name="ring")
        task.result.connect(self.ring.set_snapshot)

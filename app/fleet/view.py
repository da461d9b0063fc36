"""The Fleet view: a live card per peer, pairing, and the running pipeline ring.

Cards: this PC (refreshed every few seconds in the background), every agent
the FleetModel discovers over mDNS or polls by address (live add / update /
remove), and the peers added by address that do not answer (greyed out, with
the reason). A card says whether this app is paired with the agent; Pair…
opens the pairing dialog with the 6-digit code the agent's owner must see on
their side. Revoking is the agent owner's act (their tray, or `flotilla agent
pair --revoke`): the card says so.
"""

from __future__ import annotations

import html
import threading
import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QDialog, QDialogButtonBox, QFrame, QGridLayout, QHBoxLayout, QLabel, QLayout, QLineEdit, QProgressBar,
    QPushButton, QScrollArea, QVBoxLayout, QWidget,
)

from app import style
from app.background import Runner
from app.fleet.model import FleetModel
from app.fleet.ring_view import RingView
from app.session import EngineSession
from engine import client

REFRESH_MS = 4000  # this PC's card
RING_MS = 1000  # ring timings
PAIR_WAIT_S = 600.0  # how long the pairing dialog waits for the owner


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _since(t: float | None) -> str:
    if t is None:
        return "unknown"
    mins = max(0, int((time.time() - t) / 60))
    if mins < 1:
        return "active now"
    return f"idle {mins} min" if mins < 120 else f"idle {mins // 60} h"


def _spaced(code: str) -> str:
    return f"{code[:3]} {code[3:]}" if len(code) == 6 else code


class PeerCardWidget(QFrame):
    pair_requested = Signal(object)  # the PeerCard
    remove_requested = Signal(str)  # the manual entry

    def __init__(self, card: client.PeerCard, controller: str = "Flotilla app",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("card")
        self.card, self.controller = card, controller
        self.setMinimumWidth(300)
        self.setMaximumWidth(440)
        self.pair_button: QPushButton | None = None
        self.remove_button: QPushButton | None = None
        self.revoke_button: QPushButton | None = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 12, 14, 12)
        name = QLabel(card.name, objectName="section")
        name.setWordWrap(True)
        lay.addWidget(name)
        meta = [card.os or "OS unknown"]
        if card.local:
            meta.append("this PC")
        else:
            meta.append({"mdns": "found on the LAN", "manual": "added by address"}.get(card.source, card.source))
        self.pair_label = QLabel(self._pair_text(), objectName="muted")
        self.pair_label.setTextFormat(Qt.TextFormat.RichText)
        lay.addWidget(QLabel(" · ".join(meta), objectName="muted"))
        if not card.local and card.reachable:
            lay.addWidget(self.pair_label)
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
            user = QLabel(f"User: {_since(card.idle_since)} · {card.sharing}")
            user.setWordWrap(True)
            lay.addWidget(user)
        if card.reason:
            why = QLabel(card.reason, objectName="muted" if card.reachable else "error")
            why.setWordWrap(True)
            lay.addWidget(why)
        self.revoke_note = QLabel("", objectName="hint")
        self.revoke_note.setWordWrap(True)
        self.revoke_note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.revoke_note.hide()
        lay.addWidget(self.revoke_note)
        row = QHBoxLayout()
        if not card.local and card.reachable:
            if card.paired:
                self.revoke_button = QPushButton("Revoke…")
                self.revoke_button.setToolTip("How to withdraw this app's access to the agent")
                self.revoke_button.clicked.connect(self._explain_revoke)
                row.addWidget(self.revoke_button)
            else:
                self.pair_button = QPushButton("Pair…", objectName="primary")
                self.pair_button.setToolTip("Pair this app with the agent: both screens show the same code")
                self.pair_button.setEnabled(card.public_key != "")
                self.pair_button.clicked.connect(lambda: self.pair_requested.emit(self.card))
                row.addWidget(self.pair_button)
        if card.source == "manual" and card.address:
            self.remove_button = QPushButton("Remove")
            self.remove_button.setToolTip(f"Forget {card.address}")
            self.remove_button.clicked.connect(lambda: self.remove_requested.emit(self.card.address))
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

    def _pair_text(self) -> str:
        c = self.card
        if c.paired:
            return f"<span style='color:{style.OK}'>● paired</span> · key {c.fingerprint}"
        if c.paired is False:
            return f"<span style='color:{style.WARN}'>○ not paired</span> · key {c.fingerprint}"
        return f"pairing state unknown · key {c.fingerprint}"

    def _explain_revoke(self) -> None:
        self.revoke_note.setText(
            f"Access is granted, and withdrawn, on {self.card.name} by its owner: in its tray "
            f"(Paired controllers → Revoke) or with `flotilla agent pair --revoke "
            f"\"{self.controller}\"` there. Until then this app may plan and launch on it.")
        self.revoke_note.show()


class PairDialog(QDialog):
    """Shows the pairing code and waits (in the background) for the owner's yes."""

    def __init__(self, card: client.PeerCard, runner: Runner, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Pair with {card.name}")
        self.card = card
        self.state = "waiting"  # waiting | accepted | failed | cancelled
        self.code = ""
        self._cancel = threading.Event()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(20, 18, 20, 18)
        lay.setSizeConstraint(QLayout.SizeConstraint.SetMinimumSize)  # grows with the wrapped help text
        lay.addWidget(QLabel(f"Pairing this app with <b>{html.escape(card.name)}</b> (key {card.fingerprint})"))
        self.code_label = QLabel("······", objectName="code")
        self.code_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.code_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.code_label.setAccessibleName("Pairing code")
        lay.addWidget(self.code_label)
        self.help = QLabel("", wordWrap=True)
        self.help.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.help)
        self.status = QLabel("Asking the agent…", objectName="muted", wordWrap=True)
        lay.addWidget(self.status)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.buttons.rejected.connect(self.reject)
        lay.addWidget(self.buttons)
        self.setMinimumWidth(520)
        self._t0 = time.monotonic()
        task = runner.call(client.pair_peer, card, cancel=self._cancel, wait_s=PAIR_WAIT_S,
                           report_to="progress", name="pair")
        task.item.connect(self._on_progress)
        task.result.connect(self._on_done)
        task.failed.connect(self._on_failed)

    def _on_progress(self, values: tuple) -> None:
        code = str(values[0])
        if code != self.code:
            self.code = code
            self.code_label.setText(_spaced(code))
            self.help.setText(
                f"On {html.escape(self.card.name)}, its owner sees a pairing request in the Flotilla tray "
                f"with a code. Accept it there <b>only if it is {_spaced(code)}</b>, or type "
                f"<code>flotilla agent pair --accept {code}</code> on that PC.")
            self.adjustSize()
        waited = int(time.monotonic() - self._t0)
        self.status.setText(f"Waiting for the owner to accept… ({waited} s)")

    def _on_done(self, _state: str) -> None:
        self.state = "accepted"
        self.status.setStyleSheet(f"color: {style.OK};")
        self.status.setText(f"Paired: this app may now plan and launch on {self.card.name} "
                            "(within its owner's sharing policy).")
        self._finish_buttons()

    def _on_failed(self, exc: BaseException) -> None:
        if self.state == "cancelled":
            return
        self.state = "failed"
        self.status.setStyleSheet(f"color: {style.ERROR};")
        self.status.setText(f"Not paired: {exc}")
        self._finish_buttons()

    def _finish_buttons(self) -> None:
        self.buttons.clear()
        self.buttons.addButton(QDialogButtonBox.StandardButton.Close)
        self.buttons.rejected.connect(self.reject)

    def reject(self) -> None:
        if self.state == "waiting":
            self.state = "cancelled"
            self._cancel.set()
        super().reject()


class FleetView(QWidget):
    def __init__(self, session: EngineSession, runner: Runner, fleet: FleetModel,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session, self.runner, self.fleet = session, runner, fleet
        self.this_pc: client.PeerCard | None = None
        self.controller = "Flotilla app"  # how this app introduces itself to agents
        self.cards: list[PeerCardWidget] = []
        self.dialog: PairDialog | None = None
        self._busy = False

        root = QVBoxLayout(self)
        root.setContentsMargins(24, 18, 24, 18)
        head = QHBoxLayout()
        head.addWidget(QLabel("Fleet", objectName="title"))
        head.addStretch(1)
        self.address = QLineEdit()
        self.address.setPlaceholderText("Add a peer by address: host or host:port")
        self.address.setAccessibleName("Peer address")
        self.address.setToolTip("For networks where multicast is blocked, or another subnet "
                                "(the agent's base port, 47600 by default)")
        self.address.setMinimumWidth(260)
        self.address.returnPressed.connect(self.add_peer)
        self.add_button = QPushButton("Add peer")
        self.add_button.clicked.connect(self.add_peer)
        head.addWidget(self.address)
        head.addWidget(self.add_button)
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
        fleet.changed.connect(self._redraw)
        self.setTabOrder(self.address, self.add_button)
        self._redraw()

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
        """This PC's card (RAM, idle time, policy) in the background."""
        if self._busy:
            return
        self._busy = True

        task = self.runner.call(lambda: (client.controller_name(), client.this_pc()), name="this-pc")
        task.result.connect(self._set_this_pc)
        task.failed.connect(lambda exc: self.notice.setText(f"Cannot read this PC: {exc}"))
        task.finished.connect(lambda: setattr(self, "_busy", False))

    def _set_this_pc(self, res: tuple) -> None:
        self.controller, self.this_pc = res
        self._redraw()

    def all_cards(self) -> list[client.PeerCard]:
        """What the grid shows, in order: this PC, live peers, silent manual entries."""
        out = [self.this_pc] if self.this_pc else []
        out += self.fleet.peers()
        for entry in self.fleet.silent_entries():
            out.append(client.PeerCard(
                f"manual:{entry}", entry, "", (), 0, 0, None, "unknown", None, False, False,
                reason="cannot be contacted yet: no answer on its info port (asked every 5 s; "
                       "is `flotilla agent` running there, and its ports open?)",
                address=entry, source="manual"))
        return out

    def _redraw(self) -> None:
        fleet = self.fleet
        shown = (self.all_cards(), fleet.status, fleet.error, self.width() // 420)
        if shown == getattr(self, "_shown", None):
            return  # nothing changed: keep the widgets (and the keyboard focus on them)
        self._shown = shown
        found = len(fleet.cards)
        paired = sum(1 for c in fleet.cards.values() if c.paired)
        if fleet.error:
            self.notice.setStyleSheet(f"color: {style.ERROR};")
            self.notice.setText(f"Discovery is not running: {fleet.error}. Peers added by address are "
                                "still polled when it runs; check the network interfaces in Settings.")
        else:
            self.notice.setStyleSheet("")
            self.notice.setText(f"{fleet.status}. {found} agent{'s' if found != 1 else ''} found, "
                                f"{paired} paired with this app.")
        for w in self.cards:
            w.setParent(None)
            w.deleteLater()
        self.cards = []
        cols = max(1, min(3, self.width() // 420))
        for c in range(4):  # cards pack to the left; the spare width goes to an empty last column
            self.grid.setColumnStretch(c, 1 if c == cols else 0)
        self.grid.setRowStretch(99, 1)
        for i, card in enumerate(self.all_cards()):
            w = PeerCardWidget(card, self.controller)
            w.pair_requested.connect(self.pair)
            w.remove_requested.connect(self.remove_peer)
            self.grid.addWidget(w, i // cols, i % cols, Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
            self.cards.append(w)

    def card_widget(self, name_or_id: str) -> PeerCardWidget | None:
        return next((w for w in self.cards if name_or_id in (w.card.peer_id, w.card.name, w.card.address)), None)

    def add_peer(self) -> None:
        text = self.address.text().strip()
        if not text:
            return
        task = self.fleet.add_address(text)
        task.result.connect(lambda entry: (self.address.clear(),
                                           self.notice.setText(f"Added {entry}; asking it for its info…")))
        task.failed.connect(lambda exc: self.notice.setText(f"Cannot add “{text}”: {exc}"))

    def remove_peer(self, entry: str) -> None:
        self.fleet.remove_address(entry)

    def pair(self, card: client.PeerCard) -> PairDialog:
        self.dialog = dlg = PairDialog(card, self.runner, self)
        dlg.finished.connect(lambda _r: dlg.state == "accepted" and self.fleet.refresh(card))
        dlg.setModal(True)
        dlg.show()
        return dlg

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        self._redraw()  # re-flows the grid when the column count changes

    # -- ring ---------------------------------------------------------------------------
    def refresh_ring(self) -> None:
        engine = self.session.engine
        if engine is None or self.session.kind != "pipeline":
            self.ring.set_snapshot(None)
            return
        task = self.runner.call(client.ring_snapshot, engine, name="ring")
        task.result.connect(self.ring.set_snapshot)

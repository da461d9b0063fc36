"""The plan editor's "Peers in this plan" table: one row per stage (peer, device
picker, layers, memory bar, predicted speed, Exclude), and a button to include the
excluded peers again. The editor (app/plan/view.py) acts on its signals.
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QGridLayout, QGroupBox, QLabel, QPushButton, QWidget

from app import style
from app.plan.memory_bar import MemoryBar
from engine import client


class StageTable(QGroupBox):
    pin_requested = Signal(str, str)  # peer_id, device: the user picked a stage's device
    exclude_requested = Signal(str)  # peer_id: re-plan without this peer
    include_all_requested = Signal()  # re-plan with the excluded peers again

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Peers in this plan", parent)
        self.stage_grid = QGridLayout(self)
        self.stage_grid.setHorizontalSpacing(12)

    def fill(self, plan, peer_list: list, excluded: set[str], peer_name: Callable[[str], str]) -> None:
        """Show `plan`'s stages (None: the header only); peer_list: the peers it may use (their devices)."""
        while self.stage_grid.count():
            w = self.stage_grid.takeAt(0).widget()
            if w is not None:
                w.setParent(None)
                w.deleteLater()
        weights = f"{client.plan_precision(plan)} weights" if plan is not None else "weights"
        for col, text in enumerate(["Peer", "Device", "Layers", f"Memory ({weights} + KV + reserves)",
                                    "Predicted", ""]):
            self.stage_grid.addWidget(QLabel(text, objectName="muted"), 0, col)
        if plan is None:
            return
        peers = {p.peer_id: p for p in peer_list}
        for i, s in enumerate(plan.stages):
            r = i + 1
            swatch = QLabel(f"■ {peer_name(s.peer_id)}")
            swatch.setStyleSheet(f"color: {style.stage_colour(i)}; font-weight: 600;")
            device = QComboBox()
            device.setAccessibleName(f"Device of {peer_name(s.peer_id)}")
            for d in (peers[s.peer_id].devices if s.peer_id in peers else ()):
                device.addItem(d.name)
            device.setCurrentText(s.device)
            device.activated.connect(lambda _i, pid=s.peer_id, box=device:
                                     self.pin_requested.emit(pid, box.currentText()))
            mem = MemoryBar()
            mem.set_values(s.resident_weight_bytes, s.kv_bytes, s.margin_bytes, s.ram_free_bytes, style.stage_colour(i))
            excl = QPushButton("Exclude")
            excl.setToolTip("Re-plan without this peer")
            excl.setEnabled(len(plan.stages) > 1 or len(peers) > 1)
            excl.clicked.connect(lambda _=False, pid=s.peer_id: self.exclude_requested.emit(pid))
            for col, w in enumerate([swatch, device, QLabel(f"{s.start}–{s.end} ({s.num_layers})"), mem,
                                     QLabel(f"{s.predicted_tok_s:.0f} tok/s"), excl]):
                self.stage_grid.addWidget(w, r, col)
        if excluded:
            names = ", ".join(sorted(peer_name(p) for p in excluded))
            back = QPushButton(f"Include {names} again")
            back.clicked.connect(lambda _=False: self.include_all_requested.emit())
            self.stage_grid.addWidget(back, len(plan.stages) + 1, 0, 1, 3)

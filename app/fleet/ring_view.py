"""A drawing of the running pipeline ring: one node per stage around a circle,
coloured like its segment in the plan editor, with its utilisation as an arc
and the mean link latency on the connections.

Fed RingSnapshots (engine.client.ring_snapshot) by its owner; with none it
shows an empty-state sentence instead of a fake ring.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app import style

EMPTY = ("No pipeline is running. Launch a plan from the Plan view (this PC ×2 works "
         "without a fleet) to see its stages, their utilisation and link latency here.")


class RingView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.snapshot = None  # client.RingSnapshot | None
        self.setMinimumHeight(220)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setAccessibleName("Pipeline ring")

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(520, 300)

    def set_snapshot(self, snapshot) -> None:
        self.snapshot = snapshot
        self.setAccessibleDescription(self.describe())
        self.update()

    def describe(self) -> str:
        """The ring in words (tests and screen readers)."""
        s = self.snapshot
        if s is None:
            return EMPTY
        parts = [f"{st.label} layers {st.start}–{st.end}: {st.utilisation:.0%} busy, "
                 f"{st.compute_ms:.1f} ms/step{'' if st.alive else ', stopped'}" for st in s.stages]
        text = "; ".join(parts) + f"; link {s.link_ms:.2f} ms; {s.tokens} tokens"
        return text + (f"; broken: {s.broken}" if s.broken else "")

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt name
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        s = self.snapshot
        if s is None or not s.stages:
            p.setPen(QColor(style.MUTED))
            r = self.rect().adjusted(24, 12, -24, -12)
            p.drawText(r, Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap, EMPTY)
            return
        n = len(s.stages)
        fm = self.fontMetrics()
        node_r = max(fm.height() * 2.2, 34.0)
        cx, cy = self.width() / 2, self.height() / 2
        # An ellipse: wide rooms for the labels beside each node, any aspect ratio.
        rx = max(40.0, min(self.width() / 2 - node_r - 170, 2.2 * (self.height() / 2 - node_r)))
        ry = max(10.0, self.height() / 2 - node_r - 8)
        turn = -math.pi / 2 if n == 2 else 0.0  # two stages side by side, not stacked
        centres = [QPointF(cx + rx * math.sin(2 * math.pi * i / n + turn),
                           cy - ry * math.cos(2 * math.pi * i / n + turn)) for i in range(n)]
        # Links first (under the nodes): the ring closes from the last stage to the first.
        p.setPen(QPen(QColor(style.BORDER), 3))
        p.drawEllipse(QPointF(cx, cy), rx, ry)
        link = f"{s.link_ms:.2f} ms/hop"
        p.setPen(QColor(style.MUTED))
        p.drawText(QRectF(cx - 80, cy - fm.height(), 160, fm.height() * 2),
                   Qt.AlignmentFlag.AlignCenter, f"link {link}\n{s.tokens} tokens")
        for st, c in zip(s.stages, centres):
            colour = QColor(style.stage_colour(st.index) if st.alive else style.ERROR)
            box = QRectF(c.x() - node_r, c.y() - node_r, 2 * node_r, 2 * node_r)
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(QColor(style.SURFACE))
            p.drawEllipse(box)
            p.setBrush(Qt.BrushStyle.NoBrush)
            p.setPen(QPen(QColor(style.BORDER), 6))
            p.drawEllipse(box.adjusted(3, 3, -3, -3))
            pen = QPen(colour, 6)
            pen.setCapStyle(Qt.PenCapStyle.RoundCap)
            p.setPen(pen)
            p.drawArc(box.adjusted(3, 3, -3, -3), 90 * 16, -int(360 * 16 * max(0.01, st.utilisation)))
            p.setPen(QColor(style.TEXT))
            bold = QFont(self.font())
            bold.setBold(True)
            p.setFont(bold)
            p.drawText(box, Qt.AlignmentFlag.AlignCenter,
                       f"{st.index}\n{st.utilisation:.0%}" if st.alive else f"{st.index}\nstopped")
            p.setFont(self.font())
            p.setPen(QColor(style.MUTED))
            side = 1 if c.x() >= cx else -1
            label = QRectF(c.x() + side * (node_r + 8) - (0 if side > 0 else 150), c.y() - fm.height(),
                           150, fm.height() * 2)
            align = (Qt.AlignmentFlag.AlignLeft if side > 0 else Qt.AlignmentFlag.AlignRight) \
                | Qt.AlignmentFlag.AlignVCenter
            p.drawText(label, align, f"layers {st.start}–{st.end}\n{st.compute_ms:.1f} ms/step")
        if s.broken:
            p.setPen(QColor(style.ERROR))
            p.drawText(self.rect().adjusted(8, 0, -8, -4),
                       Qt.AlignmentFlag.AlignBottom | Qt.AlignmentFlag.AlignHCenter | Qt.TextFlag.TextWordWrap,
                       f"Ring broken: {s.broken}")

"""A memory-fit bar for one stage: weights + KV + margin against what its
peer shares. Over the limit, the overflow is red and a line marks the limit,
so "does it fit" is told by shape and text, not by colour alone."""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app import style


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.1f} GB"


class MemoryBar(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.weights = self.kv = self.margin = 0
        self.free = 1
        self.colour = style.ACCENT
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(160)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(240, self.fontMetrics().height() + 6)

    def set_values(self, weights: int, kv: int, margin: int, free: int, colour: str) -> None:
        self.weights, self.kv, self.margin, self.free, self.colour = weights, kv, margin, max(1, free), colour
        total = weights + kv + margin
        self.setToolTip(f"weights {gb(weights)} + KV {gb(kv)} + margin {gb(margin)} = {gb(total)} "
                        f"of {gb(free)} shared")
        self.setAccessibleName(self.text())
        self.update()

    @property
    def fits(self) -> bool:
        return self.weights + self.kv + self.margin <= self.free

    def text(self) -> str:
        total = self.weights + self.kv + self.margin
        return f"{gb(total)} of {gb(self.free)}" + ("" if self.fits else " — does not fit")

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt name
        p = QPainter(self)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        total = self.weights + self.kv + self.margin
        scale = r.width() / max(total, self.free)
        p.fillRect(r, QColor(style.PAGE))
        x = r.left()
        for value, colour in ((self.weights, QColor(self.colour)),
                              (self.kv, QColor(self.colour).lighter(140)),
                              (self.margin, QColor(style.BORDER))):
            w = value * scale
            p.fillRect(QRectF(x, r.top(), w, r.height()), colour)
            x += w
        if not self.fits:
            limit = r.left() + self.free * scale
            p.fillRect(QRectF(limit, r.top(), x - limit, r.height()),
                       QColor(style.ERROR))
            p.setPen(QPen(QColor(style.TEXT), 2))
            p.drawLine(int(limit), int(r.top()), int(limit), int(r.bottom()))
        p.setPen(QPen(QColor(style.BORDER), 1))
        p.drawRect(r)
        p.setPen(QColor(style.TEXT))
        # Text on a translucent plate: readable over any segment colour.
        text = self.text()
        fm = self.fontMetrics()
        plate = QRectF(r.left() + 4, r.top() + 1, fm.horizontalAdvance(text) + 8, r.height() - 2)
        p.fillRect(plate, QColor(style.SURFACE if style.theme == "light" else style.PAGE))
        p.setPen(QColor(style.ERROR if not self.fits else style.TEXT))
        p.drawText(plate, Qt.AlignmentFlag.AlignCenter, text)

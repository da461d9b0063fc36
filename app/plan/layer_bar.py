"""The plan editor's centrepiece: the model's layers as one horizontal bar,
a coloured segment per stage, boundaries you can drag.

The bar only draws and reports intent: dragging boundary k emits
`boundary_dragged(k, layer)` each time the pointer crosses into a new layer
(clamped so no stage becomes empty); the plan editor asks the planner for the
new plan and hands the bar the result. A stage that does not fit is hatched
red. Keyboard: Up/Down pick a boundary, Left/Right move it one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QKeyEvent, QMouseEvent, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app import style

GRAB_PX = 10  # a press this close to a boundary grabs it
MARGIN = 12  # px left/right of the bar, so the end handles are reachable


@dataclass(frozen=True)
class Segment:
    start: int  # first layer
    end: int  # one past the last layer
    label: str  # peer name
    fits: bool  # memory fits: drawn in the stage colour, else hatched red


class LayerBar(QWidget):
    boundary_dragged = Signal(int, int)  # (boundary index k between stage k and k+1, new layer)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.num_layers = 0
        self.segments: list[Segment] = []
        self.invalid = False  # the whole plan is invalid: red outline
        self.selected = 0  # boundary the keyboard moves
        self._drag: int | None = None
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setAccessibleName("Layer split")
        self.setToolTip("Drag a boundary to move layers between peers. "
                        "Keyboard: Up/Down pick a boundary, Left/Right move it.")

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(600, self.fontMetrics().height() * 5 + 24)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(200, self.fontMetrics().height() * 5 + 24)

    def set_plan(self, num_layers: int, segments: list[Segment], invalid: bool = False) -> None:
        self.num_layers = num_layers
        self.segments = list(segments)
        self.invalid = invalid
        self.selected = min(self.selected, max(0, len(self.segments) - 2))
        self.setAccessibleDescription(", ".join(f"{s.label}: layers {s.start}–{s.end}"
                                                + ("" if s.fits else " (does not fit)")
                                                for s in self.segments))
        self.setFixedHeight(self.sizeHint().height())
        self.update()

    # -- geometry (public for tests) -----------------------------------------------------
    def bar_rect(self) -> QRectF:
        fm = self.fontMetrics()
        top = fm.height() + 8
        return QRectF(MARGIN, top, max(1, self.width() - 2 * MARGIN), fm.height() * 2.6)

    def layer_x(self, layer: float) -> float:
        r = self.bar_rect()
        return r.left() + r.width() * layer / max(1, self.num_layers)

    def boundary_x(self, k: int) -> float:
        """x of the boundary between stage k and k + 1."""
        return self.layer_x(self.segments[k].end)

    def boundary_point(self, k: int) -> QPointF:
        return QPointF(self.boundary_x(k), self.bar_rect().center().y())

    def layer_at(self, x: float) -> int:
        r = self.bar_rect()
        return round((x - r.left()) / r.width() * self.num_layers)

    # -- painting ---------------------------------------------------------------------------
    def paintEvent(self, event) -> None:  # noqa: N802 - Qt name
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = self.bar_rect()
        fm = self.fontMetrics()
        if not self.segments or not self.num_layers:
            p.setPen(QColor(style.MUTED))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "No plan yet")
            return
        for i, seg in enumerate(self.segments):
            x0, x1 = self.layer_x(seg.start), self.layer_x(seg.end)
            box = QRectF(x0, r.top(), x1 - x0, r.height())
            colour = QColor(style.stage_colour(i))
            p.fillRect(box, colour if seg.fits else QColor(style.ERROR_BG))
            if not seg.fits:
                p.fillRect(box, QBrush(QColor(style.ERROR), Qt.BrushStyle.BDiagPattern))
            # Peer name above its segment (elided to fit), layer range inside.
            p.setPen(QColor(style.TEXT if seg.fits else style.ERROR))
            name = fm.elidedText(seg.label, Qt.TextElideMode.ElideRight, int(box.width()) - 4)
            p.drawText(QRectF(x0 + 2, 0, box.width() - 4, r.top() - 2),
                       Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignBottom, name)
            inside = f"{seg.start}–{seg.end}"
            p.setPen(QColor("#ffffff") if seg.fits else QColor(style.ERROR))
            bold = QFont(self.font())
            bold.setBold(True)
            p.setFont(bold)
            if fm.horizontalAdvance(inside) + 8 < box.width():
                p.drawText(box, Qt.AlignmentFlag.AlignCenter, inside)
            p.setFont(self.font())
        # Layer ticks below: every layer for small models, every 5th/10th for big ones.
        step = 1 if self.num_layers <= 24 else 5 if self.num_layers <= 120 else 10
        p.setPen(QColor(style.MUTED))
        for layer in range(0, self.num_layers + 1, step):
            x = self.layer_x(layer)
            p.drawLine(QPointF(x, r.bottom()), QPointF(x, r.bottom() + 4))
            p.drawText(QRectF(x - 20, r.bottom() + 4, 40, fm.height()), Qt.AlignmentFlag.AlignHCenter,
                       str(layer))
        outline = QColor(style.ERROR if self.invalid else style.BORDER)
        p.setPen(QPen(outline, 2 if self.invalid else 1))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRect(r)
        # Boundary handles.
        for k in range(len(self.segments) - 1):
            x = self.boundary_x(k)
            active = self._drag == k or (self.hasFocus() and self.selected == k)
            p.setPen(QPen(QColor(style.TEXT), 3 if active else 2))
            p.drawLine(QPointF(x, r.top() - 3), QPointF(x, r.bottom() + 3))
            p.setBrush(QColor(style.ACCENT if active else style.SURFACE))
            p.setPen(QPen(QColor(style.TEXT), 1.5))
            p.drawRoundedRect(QRectF(x - 5, r.center().y() - 10, 10, 20), 3, 3)
        if self.hasFocus():
            p.setPen(QPen(QColor(style.ACCENT), 2, Qt.PenStyle.DashLine))
            p.setBrush(Qt.BrushStyle.NoBrush)
            p.drawRect(self.rect().adjusted(1, 1, -2, -2))

    # -- mouse --------------------------------------------------------------------------------
    def _boundary_near(self, x: float) -> int | None:
        best, dist = None, GRAB_PX + 1.0
        for k in range(len(self.segments) - 1):
            d = abs(self.boundary_x(k) - x)
            if d < dist:
                best, dist = k, d
        return best

    def mousePressEvent(self, event: QMouseEvent) -> None:  # noqa: N802 - Qt name
        k = self._boundary_near(event.position().x())
        if event.button() == Qt.MouseButton.LeftButton and k is not None:
            self._drag = self.selected = k
            self.update()
        super().mousePressEvent(event)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:  # noqa: N802 - Qt name
        x = event.position().x()
        if self._drag is None:
            near = self._boundary_near(x) is not None
            self.setCursor(Qt.CursorShape.SplitHCursor if near else Qt.CursorShape.ArrowCursor)
            return
        self._move(self._drag, self.layer_at(x))

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:  # noqa: N802 - Qt name
        if self._drag is not None:
            self._move(self._drag, self.layer_at(event.position().x()))
            self._drag = None
            self.update()

    def _move(self, k: int, layer: int) -> None:
        lo, hi = self.segments[k].start + 1, self.segments[k + 1].end - 1
        layer = max(lo, min(hi, layer))
        if layer != self.segments[k].end:
            self.boundary_dragged.emit(k, layer)

    # -- keyboard ------------------------------------------------------------------------------
    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt name
        n = len(self.segments) - 1
        key = event.key()
        if n <= 0:
            return super().keyPressEvent(event)
        if key in (Qt.Key.Key_Up, Qt.Key.Key_Down):
            self.selected = (self.selected + (1 if key == Qt.Key.Key_Down else -1)) % n
            self.update()
        elif key in (Qt.Key.Key_Left, Qt.Key.Key_Right):
            delta = 1 if key == Qt.Key.Key_Right else -1
            self._move(self.selected, self.segments[self.selected].end + delta)
        else:
            super().keyPressEvent(event)

"""The multi-line prompt box: Enter sends, Shift+Enter inserts a new line.

It grows with its text from one line up to MAX_LINES, then scrolls, so a short
question does not waste space and a pasted paragraph stays visible.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QSizePolicy, QWidget

MIN_LINES, MAX_LINES = 3, 8  # 3 lines: as tall as the Send/Stop column


class PromptEdit(QPlainTextEdit):
    submitted = Signal()  # Enter without Shift: the owner reads text() and sends

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("prompt")
        self.setTabChangesFocus(True)  # Tab moves to Send, as in any form
        self.setPlaceholderText("Message the model…  (Enter to send, Shift+Enter for a new line)")
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().contentsChanged.connect(self._fit_height)
        self._fit_height()

    def text(self) -> str:
        return self.toPlainText()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt name
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = event.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                # Insert a plain newline ourselves: QPlainTextEdit would insert
                # a line separator (U+2028) for Shift+Enter.
                self.insertPlainText("\n")
                return
            if not mods & (Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.AltModifier):
                self.submitted.emit()
                return
        super().keyPressEvent(event)

    def _fit_height(self) -> None:
        lines = max(MIN_LINES, min(MAX_LINES, self.document().blockCount()))
        line_h = self.fontMetrics().lineSpacing()
        margins = self.contentsMargins()
        frame = int(self.document().documentMargin() * 2) + margins.top() + margins.bottom()
        self.setFixedHeight(lines * line_h + frame + 6)

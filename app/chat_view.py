"""The chat transcript: turns rendered as simple HTML bubbles.

Qt's rich-text engine is a small HTML subset: no border-radius, and padding
only inside table cells. So each bubble is a one-cell table (cellpadding gives
it room to breathe), aligned right for the user and left for the assistant.

Streaming re-renders the whole document. That is O(turns) per refresh, so
refreshes are coalesced with a short timer: tokens can arrive hundreds a
second, a person reads at most a few dozen frames a second.
"""

from __future__ import annotations

import html

from PySide6.QtCore import QTimer
from PySide6.QtGui import QTextCursor, QTextTable
from PySide6.QtWidgets import QTextBrowser, QWidget

from app.conversation import CANCELLED, ERROR, STREAMING, Conversation, Turn
from app import style

REFRESH_MS = 30  # at most ~33 repaints a second while streaming
DOC_MARGIN = 18  # px around the transcript
BUBBLE_MAX = 0.78  # a long bubble wraps at this fraction of the width, like chat apps do
PADDING = 12  # px inside a bubble


# C0 control characters (other than tab and newline) would be dropped or
# garble the layout; show them as their Unicode "control pictures" (U+2400+)
# so what the model produced stays visible and honest.
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\t\n"}
_CONTROL_PICTURES[0x7F] = 0x2421


def display_text(text: str) -> str:
    """The text a bubble shows for `text` (exactly, modulo control characters)."""
    return text.replace("\r\n", "\n").translate(_CONTROL_PICTURES)


def _escape(text: str) -> str:
    # white-space:pre-wrap keeps runs of spaces; newlines become explicit
    # breaks because Qt's importer folds them otherwise.
    return html.escape(display_text(text)).replace("\n", "<br>")


class ChatView(QTextBrowser):
    def __init__(self, conversation: Conversation, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self._conversation = conversation
        self.setOpenLinks(False)  # answers are plain text; never navigate away
        self.document().setDocumentMargin(DOC_MARGIN)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(REFRESH_MS)
        self._timer.timeout.connect(self.render_now)
        self.render_now()

    # -- public ------------------------------------------------------------------
    def schedule_render(self) -> None:
        """Re-render soon (coalesces bursts of tokens)."""
        if not self._timer.isActive():
            self._timer.start()

    def render_now(self) -> None:
        self._timer.stop()
        bar = self.verticalScrollBar()
        # Follow the answer only if the reader is already at the bottom; do
        # not yank them back down while they scroll up to reread something.
        at_bottom = bar.value() >= bar.maximum() - 4
        keep = bar.value()
        self.setHtml(self._html())
        bar.setValue(bar.maximum() if at_bottom else keep)

    def bubble_texts(self) -> list[str]:
        """The text of every bubble as rendered, in order (for tests and
        accessibility checks: what the user actually sees)."""
        out = []
        root = self.document().rootFrame()
        for frame in root.childFrames():
            if isinstance(frame, QTextTable):
                cell = frame.cellAt(0, 0)
                cursor = cell.firstCursorPosition()
                cursor.setPosition(cell.lastCursorPosition().position(),
                                   QTextCursor.MoveMode.KeepAnchor)
                text = cursor.selectedText()
                # Qt marks paragraph and line breaks with Unicode separators.
                out.append(text.replace("\u2029", "\n").replace("\u2028", "\n")
                           .replace("\u00a0", " "))
        return out

    # -- rendering ---------------------------------------------------------------
    def _html(self) -> str:
        turns = self._conversation.turns
        if not turns:
            return self._empty_html()
        body = "".join(self._bubble(t) for t in turns)
        return f"<html><body style=\"{style.CHAT_BODY_CSS}\">{body}</body></html>"

    def _empty_html(self) -> str:
        return (
            f"<html><body style=\"{style.CHAT_BODY_CSS}\">"
            f"<p align=\"center\" style=\"margin-top:140px; color:{style.MUTED}; font-size:15pt;\">"
            "Start a conversation</p>"
            f"<p align=\"center\" style=\"color:{style.MUTED};\">"
            "Type below and press Enter to send · Shift+Enter for a new line</p>"
            "</body></html>"
        )

    def _bubble(self, turn: Turn) -> str:
        user = turn.role == "user"
        who = "You" if user else "Assistant"
        align = "right" if user else "left"
        bg = style.USER_BUBBLE if user else style.ASSISTANT_BUBBLE
        fg = style.USER_TEXT if user else style.TEXT
        text = _escape(turn.text)
        if turn.state == STREAMING:
            # A caret so an answer that has not produced text yet still shows life.
            text += f"<span style=\"color:{style.ACCENT};\">&#9613;</span>"
        elif not turn.text:
            text = f"<i style=\"color:{style.MUTED};\">(no text)</i>"
        label = (f"<p align=\"{align}\" style=\"margin:14px 4px 4px 4px; font-size:9pt; "
                 f"font-weight:600; color:{style.MUTED};\">{who}</p>")
        # Qt lays a right-floated table against the viewport edge, ignoring
        # the document margin; an explicit right margin puts it back.
        margin = f"margin-right:{DOC_MARGIN}px;" if user else ""
        bubble = (
            f"<table align=\"{align}\" cellspacing=\"0\" cellpadding=\"{PADDING}\" "
            f"bgcolor=\"{bg}\"{self._width_attr(turn.text)} style=\"border:none; {margin}\">"
            f"<tr><td style=\"color:{fg}; white-space:pre-wrap;\">{text}</td></tr></table>"
        )
        note = self._note(turn, align)
        return label + bubble + note

    def _width_attr(self, text: str) -> str:
        # Tables shrink to their content but have no max-width: give a fixed
        # fraction only to bubbles whose longest line would run wider.
        available = self.viewport().width() - 2 * DOC_MARGIN
        longest = max((self.fontMetrics().horizontalAdvance(line)
                       for line in display_text(text).split("\n")), default=0)
        if longest + 2 * PADDING + 8 > BUBBLE_MAX * available:
            return f" width=\"{int(BUBBLE_MAX * 100)}%\""
        return ""

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        if self._conversation.turns:
            self.schedule_render()  # bubble widths depend on the viewport

    def _note(self, turn: Turn, align: str) -> str:
        if turn.state == ERROR:
            color, text = style.ERROR, turn.note or "error"
        elif turn.state == CANCELLED:
            color, text = style.MUTED, turn.note or "stopped"
        elif turn.note:
            color, text = style.MUTED, turn.note
        else:
            # An empty paragraph still clears the floated table above it.
            return "<p style=\"margin:0;\"></p>"
        return (f"<p align=\"{align}\" style=\"margin:4px 4px 0 4px; font-size:8.5pt; "
                f"color:{color};\">{html.escape(text)}</p>")

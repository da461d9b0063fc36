"""The chat transcript: turns rendered as HTML bubbles, answers as Markdown.

Qt's rich-text engine is a small HTML subset: no border-radius, and padding
only inside table cells. So each bubble is a one-cell table (cellpadding gives
it room to breathe), aligned right for the user and left for the assistant.
Answers go through QTextDocument.setMarkdown and the resulting HTML body is
put in the cell, with code blocks given a background (Qt draws block
backgrounds) so they read as code. User text is shown exactly, never parsed.

Streaming re-renders the document. That is O(turns), so the HTML of every
finished turn is cached (only the streaming answer is converted again) and
refreshes are coalesced with a short timer: tokens arrive hundreds a second,
a person reads at most a few dozen frames a second.

Under each bubble are action links (Copy, Edit, Regenerate); links are
keyboard reachable (Tab in the transcript, Enter follows), and `action`
fires with (verb, turn index).
"""

from __future__ import annotations

import html
import re

from PySide6.QtCore import QTimer, QUrl, Qt, Signal
from PySide6.QtGui import QTextCursor, QTextDocument, QTextTable
from PySide6.QtWidgets import QTextBrowser, QWidget

from app import style
from app.chat.conversation import CANCELLED, ERROR, STREAMING, Conversation, Turn

REFRESH_MS = 40  # at most 25 repaints a second while streaming
DOC_MARGIN = 18  # px around the transcript
BUBBLE_MAX = 0.78  # a long bubble wraps at this fraction of the width, like chat apps do
PADDING = 12  # px inside a bubble

# C0 control characters (other than tab and newline) would be dropped or
# garble the layout; show them as their Unicode "control pictures" (U+2400+)
# so what the model produced stays visible and honest.
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\t\n"}
_CONTROL_PICTURES[0x7F] = 0x2421
_BODY = re.compile(r"<body[^>]*>(.*)</body>", re.S)


def display_text(text: str) -> str:
    """The text a bubble shows for `text` (exactly, modulo control characters)."""
    return text.replace("\r\n", "\n").translate(_CONTROL_PICTURES)


def _escape(text: str) -> str:
    # white-space:pre-wrap keeps runs of spaces; newlines become explicit
    # breaks because Qt's importer folds them otherwise.
    return html.escape(display_text(text)).replace("\n", "<br>")


def markdown_html(text: str) -> str:
    """HTML (body content only) for Markdown `text`, code styled for the theme."""
    doc = QTextDocument()
    doc.setMarkdown(display_text(text))
    m = _BODY.search(doc.toHtml())
    body = m.group(1) if m else html.escape(text)
    mono = "font-family:'monospace';"
    code = f"font-family:'DejaVu Sans Mono','Consolas','monospace'; background-color:{style.CODE_BG};"
    body = body.replace(mono, code)
    # Code blocks: one <pre> per line; a background on each joins them into a block.
    body = body.replace("<pre style=\"", f"<pre style=\"background-color:{style.CODE_BG}; ")
    return body


class ChatView(QTextBrowser):
    action = Signal(str, int)  # ("copy" | "edit" | "regenerate", turn index)

    def __init__(self, conversation: Conversation, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setAccessibleName("Conversation transcript")
        self._conversation = conversation
        self.setOpenLinks(False)  # our links are actions; never navigate away
        self.setOpenExternalLinks(False)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction
                                     | Qt.TextInteractionFlag.LinksAccessibleByKeyboard)
        self.anchorClicked.connect(self._on_anchor)
        self.document().setDocumentMargin(DOC_MARGIN)
        self._cache: dict[int, tuple[tuple, str]] = {}  # id(turn) -> (key, html)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(REFRESH_MS)
        self._timer.timeout.connect(self.render_now)
        self.render_now()

    # -- public ------------------------------------------------------------------
    def set_conversation(self, conversation: Conversation) -> None:
        self._conversation = conversation
        self._cache.clear()
        self.render_now()

    def schedule_render(self) -> None:
        """Re-render soon (coalesces bursts of tokens)."""
        if not self._timer.isActive():
            self._timer.start()

    def restyle(self) -> None:
        """The theme changed: drop cached HTML (it holds colours) and redraw."""
        self._cache.clear()
        self.render_now()

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
                           .replace("\u00a0", " ").replace("\u258d", ""))
        return out

    # -- rendering ---------------------------------------------------------------
    def _html(self) -> str:
        turns = self._conversation.turns
        if not turns:
            return self._empty_html()
        last_user = self._conversation.last_user_index()
        body = "".join(self._bubble(i, t, last_user) for i, t in enumerate(turns))
        return f"<html><body style=\"{style.CHAT_BODY_CSS}\">{body}</body></html>"

    def _empty_html(self) -> str:
        return (
            f"<html><body style=\"{style.CHAT_BODY_CSS}\">"
            f"<p align=\"center\" style=\"margin-top:120px; color:{style.MUTED}; font-size:15pt;\">"
            "Start a conversation</p>"
            f"<p align=\"center\" style=\"color:{style.MUTED};\">"
            "Type below and press Enter to send · Shift+Enter for a new line</p>"
            "</body></html>"
        )

    def _bubble(self, index: int, turn: Turn, last_user: int | None) -> str:
        last = index == len(self._conversation.turns) - 1
        key = (turn.text, turn.state, turn.note, self.viewport().width(), last,
               index == last_user, style.theme)
        cached = self._cache.get(id(turn))
        if cached is not None and cached[0] == key:
            return cached[1]
        out = self._bubble_html(index, turn, last, index == last_user)
        if turn.state != STREAMING:
            self._cache[id(turn)] = (key, out)
        return out

    def _bubble_html(self, index: int, turn: Turn, last: bool, last_user: bool) -> str:
        user = turn.role == "user"
        who = "You" if user else "Assistant"
        align = "right" if user else "left"
        bg = style.USER_BUBBLE if user else style.ASSISTANT_BUBBLE
        fg = style.USER_TEXT if user else style.TEXT
        if user:
            text = _escape(turn.text)
        elif turn.text:
            text = markdown_html(turn.text)
        else:
            text = ""
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
        white = "white-space:pre-wrap;" if user else ""
        bubble = (
            f"<table align=\"{align}\" cellspacing=\"0\" cellpadding=\"{PADDING}\" "
            f"bgcolor=\"{bg}\"{self._width_attr(turn.text)} style=\"border:none; {margin}\">"
            f"<tr><td style=\"color:{fg}; {white}\">{text}</td></tr></table>"
        )
        return label + bubble + self._note(index, turn, align, last, last_user)

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

    def _note(self, index: int, turn: Turn, align: str, last: bool, last_user: bool) -> str:
        parts = []
        if turn.state == ERROR:
            parts.append(f"<span style=\"color:{style.ERROR};\">{html.escape(turn.note or 'error')}</span>")
        elif turn.state == CANCELLED:
            parts.append(html.escape(turn.note or "stopped"))
        elif turn.note:
            parts.append(html.escape(turn.note))
        if turn.state != STREAMING:
            links = [("copy", "Copy")]
            if turn.role == "user" and last_user:
                links.append(("edit", "Edit"))
            if turn.role == "assistant" and last:
                links.append(("regenerate", "Regenerate"))
            parts.append(" &nbsp;".join(f"<a href=\"act:{verb}:{index}\" style=\"color:{style.ACCENT}; "
                                  f"text-decoration:none;\">{label}</a>" for verb, label in links))
        if not parts:
            # An empty paragraph still clears the floated table above it.
            return "<p style=\"margin:0;\"></p>"
        return (f"<p align=\"{align}\" style=\"margin:4px 4px 0 4px; font-size:8.5pt; "
                f"color:{style.MUTED};\">{' &nbsp;·&nbsp; '.join(parts)}</p>")

    def _on_anchor(self, url: QUrl) -> None:
        parts = url.toString().split(":")
        if len(parts) == 3 and parts[0] == "act" and parts[2].isdigit():
            self.action.emit(parts[1], int(parts[2]))

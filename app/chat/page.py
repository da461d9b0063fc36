"""The Chat view: the saved conversations on the left, one open on the right.

A conversation detached into its own window (ChatWindow) is marked "(own
window)" in the list; choosing it raises that window instead of opening it
twice, so two panels never write the same conversation.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QMainWindow, QPushButton, QVBoxLayout,
    QWidget,
)

from app import style
from app.background import Runner
from app.chat.panel import ChatPanel, load_conversation
from app.chat.conversation import Conversation
from app.session import EngineSession
from app.chat.store import ChatStore

ID_ROLE = Qt.ItemDataRole.UserRole


class ChatWindow(QMainWindow):
    """A conversation in its own window, on the same engine as the main window."""

    def __init__(self, session: EngineSession, store: ChatStore, runner: Runner, cid: str) -> None:
        super().__init__()
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.setWindowIcon(style.app_icon())
        self.cid = cid
        self.panel = ChatPanel(session, store, runner, detachable=False)
        self.panel.show_conversation(load_conversation(store, cid))
        self.panel.title_changed.connect(lambda _c, t: self.setWindowTitle(f"{t} — Flotilla"))
        self.setWindowTitle(f"{self.panel.conversation.title} — Flotilla")
        self.setCentralWidget(self.panel)
        self.resize(760, 640)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt name
        self.panel.stop()  # the partial answer is already saved
        super().closeEvent(event)


class ChatPage(QWidget):
    def __init__(self, session: EngineSession, store: ChatStore, runner: Runner,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session, self.store, self.runner = session, store, runner
        self.windows: dict[str, ChatWindow] = {}

        left = QWidget(objectName="sidebar")
        left.setFixedWidth(240)
        ll = QVBoxLayout(left)
        ll.setContentsMargins(10, 12, 10, 12)
        head = QLabel("Conversations", objectName="section")
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_chat)
        self.list = QListWidget()
        self.list.setAccessibleName("Conversations")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.itemActivated.connect(self._open_item)
        self.list.itemClicked.connect(self._open_item)
        self.delete_button = QPushButton("Delete")
        self.delete_button.setToolTip("Delete the selected conversation")
        self.delete_button.clicked.connect(self._delete_selected)
        ll.addWidget(head)
        ll.addWidget(self.new_button)
        ll.addWidget(self.list, 1)
        ll.addWidget(self.delete_button)

        self.panel = ChatPanel(session, store, runner)
        self.panel.title_changed.connect(lambda _c, _t: self.refresh())
        self.panel.detach_requested.connect(self.detach)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(left)
        row.addWidget(self.panel, 1)
        QShortcut(QKeySequence("Ctrl+N"), self, self.new_chat,
                  context=Qt.ShortcutContext.WidgetWithChildrenShortcut)
        self.setTabOrder(self.new_button, self.list)
        self.setTabOrder(self.list, self.delete_button)
        self.refresh()
        saved = store.conversations()
        if saved:  # reopen the most recent conversation: the user finds it where they left it
            self.open_conversation(saved[0].id)

    def refresh(self) -> None:
        current = self.panel.conversation.id
        self.list.blockSignals(True)
        self.list.clear()
        for conv in self.store.conversations():
            title = conv.title + ("  (own window)" if conv.id in self.windows else "")
            item = QListWidgetItem(title)
            item.setData(ID_ROLE, conv.id)
            item.setToolTip(conv.title)
            self.list.addItem(item)
            if conv.id == current:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self.delete_button.setEnabled(self.list.count() > 0)

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def new_chat(self) -> None:
        self.panel.show_conversation(Conversation())
        self.list.clearSelection()
        self.panel.prompt.setFocus()

    def open_conversation(self, cid: str) -> None:
        if cid in self.windows:
            self.windows[cid].raise_()
            self.windows[cid].activateWindow()
            return
        if cid != self.panel.conversation.id:
            self.panel.show_conversation(load_conversation(self.store, cid))
        self.refresh()

    def _open_item(self, item: QListWidgetItem) -> None:
        self.open_conversation(item.data(ID_ROLE))

    def _delete_selected(self) -> None:
        item = self.list.currentItem()
        if item is None:
            return
        cid = item.data(ID_ROLE)
        if cid in self.windows:
            self.windows.pop(cid).close()
        if cid == self.panel.conversation.id:
            self.new_chat()
        self.store.delete(cid)
        self.refresh()

    def detach(self, cid: str) -> ChatWindow:
        """Move the open conversation into its own window; this panel starts a new chat."""
        if self.panel.answering:
            self.panel.stop()
        win = ChatWindow(self.session, self.store, self.runner, cid)
        self.windows[cid] = win
        win.destroyed.connect(lambda *_: self._window_closed(cid))
        self.new_chat()
        win.show()
        self.refresh()
        return win

    def _window_closed(self, cid: str) -> None:
        self.windows.pop(cid, None)
        self.refresh()

    def restyle(self) -> None:
        self.panel.restyle()
        for w in self.windows.values():
            w.panel.restyle()

    def close_windows(self) -> None:
        for w in list(self.windows.values()):
            w.close()

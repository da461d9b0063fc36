"""The main window: a sidebar (Fleet, Models, Plan, Chat, Settings) and the
view it selects, over one shared engine session, runner and chat store.

Ctrl+1..5 switch views; the sidebar buttons are in the tab order with a
visible focus ring. On start the window opens the last model (the demo on a
first start: it is built and compiled on first use, no set-up) on the local
engine, and shows the Chat view.

Closing is two-phase: the first close stops answers, the API server and the
engine in the background; the window really closes once the runner is idle
(or after a grace period, so a stuck engine never hangs the exit).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication, QButtonGroup, QHBoxLayout, QLabel, QMainWindow, QProgressBar, QStackedWidget,
    QToolButton, QVBoxLayout, QWidget,
)

from app import style
from app.background import Runner
from app.chat.page import ChatPage
from app.fleet.model import FleetModel
from app.fleet.view import FleetView
from app.models.view import ModelsView
from app.plan.view import PlanView
from app.session import CLOSING, FAILED, OPENING, READY, EngineSession
from app.settings import AppSettings
from app.preferences.view import SettingsView
from app.chat.store import ChatStore
from engine import client

VIEWS = [("fleet", "Fleet"), ("models", "Models"), ("plan", "Plan"), ("chat", "Chat"), ("settings", "Settings")]
CLOSE_GRACE_MS = 10_000


def resolve_theme(name: str) -> str:
    if name in ("light", "dark"):
        return name
    scheme = QGuiApplication.styleHints().colorScheme()
    return "dark" if scheme == Qt.ColorScheme.Dark else "light"


class MainWindow(QMainWindow):
    shut_down = Signal()  # the engine is closed; the window is gone

    def __init__(self, config: Path, data: Path, spec: str | None = None, device: str = "CPU",
                 open_engine: bool = True) -> None:
        super().__init__()
        self.setWindowTitle("Flotilla")
        self.setWindowIcon(style.app_icon())
        self.setMinimumSize(QSize(900, 600))
        self.resize(1280, 800)
        self.config, self.data = config, data
        self.settings = AppSettings.load(config)
        self.runner = Runner(self, max_threads=12)
        self.runner.idle.connect(self._finish_when_idle)
        self.store = ChatStore(data)
        self.session = EngineSession(self.runner, self)
        self._closing = False
        self._is_shut_down = False
        self.apply_theme(self.settings.theme)

        self.fleet_model = FleetModel(self.runner, self.settings.fleet_interfaces, self)
        self.fleet = FleetView(self.session, self.runner, self.fleet_model)
        self.models = ModelsView(self.session, self.runner)
        self.plan = PlanView(self.session, self.runner, self.fleet_model)
        self.chat = ChatPage(self.session, self.store, self.runner)
        self.settings_view = SettingsView(self.session, self.runner, self.settings, config, data)
        self.settings_view.theme_chosen.connect(self.apply_theme)
        self.settings_view.interfaces_chosen.connect(self.fleet_model.start)
        self.fleet_model.start()
        self.models.plan_requested.connect(self._plan_model)
        self._build()
        self.session.changed.connect(self._sync_status)
        self.session.progress.connect(self._on_progress)
        self.show_view("chat")
        if open_engine:
            self.session.open(spec or self.settings.last_model or "demo", "local", device)
        self._sync_status()

    # -- layout ----------------------------------------------------------------------------
    def _build(self) -> None:
        central = QWidget(objectName="central")
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        side = QWidget(objectName="sidebar")
        side.setFixedWidth(max(88, self.fontMetrics().horizontalAdvance("Settings") + 40))
        sl = QVBoxLayout(side)
        sl.setContentsMargins(8, 12, 8, 12)
        sl.setSpacing(6)
        logo = QLabel()
        logo.setPixmap(style.app_icon().pixmap(36, 36))
        logo.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        sl.addWidget(logo)
        sl.addSpacing(8)
        self.stack = QStackedWidget()
        self.pages = {"fleet": self.fleet, "models": self.models, "plan": self.plan,
                      "chat": self.chat, "settings": self.settings_view}
        self.nav: dict[str, QToolButton] = {}
        group = QButtonGroup(self)
        group.setExclusive(True)
        for i, (key, label) in enumerate(VIEWS):
            b = QToolButton(objectName="nav")
            b.setText(label)
            b.setToolTip(f"{label} (Ctrl+{i + 1})")
            b.setAccessibleName(label)
            b.setCheckable(True)
            b.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextUnderIcon)
            b.setIconSize(QSize(24, 24))
            b.setSizePolicy(b.sizePolicy().horizontalPolicy().Expanding, b.sizePolicy().verticalPolicy())
            b.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
            b.clicked.connect(lambda _=False, k=key: self.show_view(k))
            group.addButton(b)
            sl.addWidget(b)
            self.nav[key] = b
            self.stack.addWidget(self.pages[key])
            QShortcut(QKeySequence(f"Ctrl+{i + 1}"), self, lambda k=key: self.show_view(k, focus=True))
        sl.addStretch(1)
        row.addWidget(side)
        row.addWidget(self.stack, 1)
        self.setCentralWidget(central)
        self._paint_icons()

        self.status_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setTextVisible(False)
        self.progress.setFixedWidth(180)
        self.progress.hide()
        self.statusBar().setSizeGripEnabled(False)
        self.statusBar().addWidget(self.status_label, 1)
        self.statusBar().addPermanentWidget(self.progress)

    def _paint_icons(self) -> None:
        for key, b in self.nav.items():
            b.setIcon(style.icon(f"nav-{key}", style.TEXT if b.isChecked() else style.MUTED))

    def show_view(self, key: str, focus: bool = False) -> None:
        self.stack.setCurrentWidget(self.pages[key])
        self.nav[key].setChecked(True)
        self._paint_icons()
        if focus:
            # Land the keyboard where the work is: the prompt in Chat, else the sidebar button.
            (self.chat.panel.prompt if key == "chat" else self.nav[key]).setFocus()

    def current_view(self) -> str:
        return next(k for k, w in self.pages.items() if w is self.stack.currentWidget())

    def _plan_model(self, spec: str) -> None:
        if spec:
            self.plan.set_model(spec)
            self.show_view("plan")

    # -- theme -------------------------------------------------------------------------------
    def apply_theme(self, name: str) -> None:
        style.apply(resolve_theme(name))
        app = QApplication.instance()
        app.setPalette(style.palette())
        app.setStyleSheet(style.STYLESHEET)
        if hasattr(self, "nav"):
            self._paint_icons()
            self.chat.restyle()
            self.plan.restyle()
            for w in (self.fleet, self.models, self.settings_view):
                w.update()

    # -- status -------------------------------------------------------------------------------
    def _sync_status(self) -> None:
        s = self.session
        self.progress.setVisible(s.state == OPENING)
        if s.state == READY:
            client.settle_heap()  # later collections skip what torch & co. hold (a full one: 150-480 ms of frozen GUI)
            self.status_label.setStyleSheet("")
            plan = f" ({s.plan_text})" if s.plan_text else ""
            self.status_label.setText(f"{s.label()}{plan} · ready")
            if s.kind == "local" and s.spec and s.spec != self.settings.last_model:
                self.settings.last_model = s.spec
                self.settings.save(self.config)
        elif s.state == OPENING:
            self.progress.setValue(0)
            self.status_label.setStyleSheet("")
            self.status_label.setText(f"Starting {s.kind} engine for {s.spec}…")
        elif s.state == FAILED:
            self.status_label.setStyleSheet(f"color: {style.ERROR};")
            self.status_label.setText(f"No engine: {s.error}")
        elif s.state == CLOSING:
            self.status_label.setText("Closing…")

    def _on_progress(self, message: str, fraction: float) -> None:
        self.status_label.setText(f"Starting {self.session.kind} engine for {self.session.spec}… {message}")
        self.progress.setValue(int(max(0.0, min(1.0, fraction)) * 100))

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.chat.panel.stop()
        self.chat.close_windows()
        self.fleet_model.stop()
        self.settings_view.shutdown()
        self.session.shutdown()
        QTimer.singleShot(CLOSE_GRACE_MS, self._force_shutdown)
        self._finish_when_idle()

    def _finish_when_idle(self) -> None:
        if self._closing and not self._is_shut_down and self.runner.active() == 0 \
                and self.session.state == CLOSING:
            self._force_shutdown()

    def _force_shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.store.close()
        self.shut_down.emit()
        self.close()

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt name
        if self._is_shut_down:
            event.accept()
            return
        event.ignore()
        self.shutdown()

"""The agent's tray icon: what `flotilla agent` shows when a display exists.

Thin on purpose: the agent itself runs as its own process (`flotilla agent
--headless`, started here through engine.client.AgentHandle.spawn), so Qt
never shares a process with it; the tray reads its state (the info port, the
pairing book, the sharing policy: the same files `flotilla agent pair` and
`flotilla agent policy` use) once a second on the Runner and drives it
through the same files:

  icon      idle (grey: nothing shared, you are using the PC), sharing (green:
            lent to the fleet), busy (blue: a shard worker computes), paused
            (amber: the owner switched sharing off, or the agent stopped)
  menu      Share now · Pause sharing · Policy… · pairing requests (each with
            its code: Accept / Deny) · paired controllers (Revoke) · Quit
  notes     a pairing request arrives; fleet work starts; the agent yields

    flotilla agent              (a display: this tray + the agent)
    python -m app.tray [AGENT ARGS]
"""

from __future__ import annotations

import signal
import sys

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QAction, QIcon
from PySide6.QtWidgets import (
    QApplication, QDialog, QDialogButtonBox, QLabel, QMenu, QSystemTrayIcon, QVBoxLayout, QWidget,
)

from app import style
from app.background import Runner
from app.gui_gc import GuiThreadCollector
from app.preferences.policy_form import PolicyForm
from engine import client

POLL_MS = 1000
ICON_FOR = {"idle": "tray-idle", "sharing": "tray-sharing", "busy": "tray-busy", "paused": "tray-paused",
            "stopped": "tray-paused", "starting": "tray-idle"}


def tray_icon(state: str) -> QIcon:
    return QIcon(str(style.ICON_DIR / f"{ICON_FOR.get(state, 'tray-idle')}.svg"))


def _spaced(code: str) -> str:
    return f"{code[:3]} {code[3:]}" if len(code) == 6 else code


class PolicyDialog(QDialog):
    """The sharing policy of this PC (the same form as the app's Settings)."""

    def __init__(self, policy: dict, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Flotilla — when this PC may be shared")
        self.setWindowIcon(style.app_icon())
        lay = QVBoxLayout(self)
        lay.setContentsMargins(20, 18, 20, 18)
        self.form = PolicyForm()
        self.form.set_policy(policy)
        lay.addWidget(self.form)
        self.status = QLabel("", objectName="hint", wordWrap=True)
        lay.addWidget(self.status)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)


class Tray(QObject):
    """The tray icon and its menu over one AgentHandle (set later while the agent starts)."""

    state_changed = Signal(object)  # client.AgentState, after the menu was updated
    notified = Signal(str, str)  # (title, message) of each notification (tests, logs)
    quit_requested = Signal()

    def __init__(self, runner: Runner, handle: client.AgentHandle | None = None, poll_ms: int = POLL_MS,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.runner = runner
        self.handle = handle
        self.state: client.AgentState | None = None
        self.icon_state = "starting"
        self.dialog: PolicyDialog | None = None
        self._reading = False
        self._notified_keys: set[str] = set()
        self.icon = QSystemTrayIcon(tray_icon("starting"), self)
        self.icon.setToolTip("Flotilla agent: starting…")
        self.menu = QMenu()
        self.header = self.menu.addAction("Starting the agent…")
        self.header.setEnabled(False)
        self.menu.addSeparator()
        self.share_action = self.menu.addAction("Share now")
        self.share_action.setCheckable(True)
        self.share_action.setToolTip("Lend this PC now, without waiting until you are away")
        self.share_action.triggered.connect(self._toggle_share_now)
        self.pause_action = self.menu.addAction("Pause sharing")
        self.pause_action.setCheckable(True)
        self.pause_action.triggered.connect(self._toggle_pause)
        self.policy_action = self.menu.addAction("Policy…")
        self.policy_action.triggered.connect(self.open_policy)
        self.menu.addSeparator()
        self.requests_header = self.menu.addAction("No pairing requests")
        self.requests_header.setEnabled(False)
        self._request_menus: list[QMenu] = []
        self.request_actions: dict[str, tuple[QAction, QAction]] = {}  # code -> (accept, deny)
        self.paired_menu = self.menu.addMenu("Paired controllers")
        self.revoke_actions: dict[str, QAction] = {}  # fingerprint -> action
        self.menu.addSeparator()
        self.quit_action = self.menu.addAction("Quit (stop sharing this PC)")
        self.quit_action.triggered.connect(self.quit_requested.emit)
        self._pending_key: tuple = ()
        self._paired_key: tuple | None = None
        self.icon.setContextMenu(self.menu)
        self._timer = QTimer(self, interval=poll_ms)
        self._timer.timeout.connect(self.poll)
        self._timer.start()
        self._sync_enabled()
        if handle is not None:
            self.poll()

    def show(self) -> None:
        self.icon.show()

    def set_handle(self, handle: client.AgentHandle) -> None:
        self.handle = handle
        self._sync_enabled()
        self.poll()

    # -- reading --------------------------------------------------------------------
    def poll(self) -> None:
        if self.handle is None or self._reading:
            return
        self._reading = True
        task = self.runner.call(self.handle.state, name="agent-state")
        task.result.connect(self._apply)
        task.finished.connect(lambda: setattr(self, "_reading", False))

    def _apply(self, st: client.AgentState) -> None:
        old = self.state
        self.state = st
        if st.state != self.icon_state:
            self.icon.setIcon(tray_icon(st.state))
            if old is not None:
                self._note_transition(old.state, st.state)
            self.icon_state = st.state
        self.icon.setToolTip(f"Flotilla agent: {st.summary}")
        self.header.setText(st.summary)
        self.share_action.setChecked(st.share_now)
        self.pause_action.setChecked(st.paused)
        self._fill_requests(st.pending)
        self._fill_paired(st.paired)
        self._sync_enabled()
        self.state_changed.emit(st)

    def _sync_enabled(self) -> None:
        running = self.state is not None and self.state.running
        for a in (self.share_action, self.pause_action):
            a.setEnabled(running)
        self.policy_action.setEnabled(self.handle is not None)

    def _note_transition(self, before: str, after: str) -> None:
        if after == "busy":
            self.notify("Fleet work started", "A paired controller is running a model shard on this PC. "
                                              "It stops within 2 s when you come back.")
        elif before == "busy" and after in ("idle", "paused"):
            self.notify("This PC is yours again", "Fleet work on this PC stopped.")
        elif after == "stopped":
            self.notify("The Flotilla agent stopped", "This PC is not shared any more.")

    def _fill_requests(self, pending: tuple) -> None:
        key = tuple((r.fingerprint, r.code) for r in pending)
        if key == self._pending_key:
            return
        self._pending_key = key
        for m in self._request_menus:
            self.menu.removeAction(m.menuAction())
            m.deleteLater()
        self._request_menus, self.request_actions = [], {}
        self.requests_header.setText(f"Pairing requests ({len(pending)})" if pending else "No pairing requests")
        for r in pending:
            m = QMenu(f"“{r.name}” — code {_spaced(r.code)}", self.menu)
            accept = m.addAction(f"Accept: its screen shows {_spaced(r.code)}")
            deny = m.addAction("Deny")
            accept.triggered.connect(lambda _=False, c=r.code: self.accept(c))
            deny.triggered.connect(lambda _=False, c=r.code: self.deny(c))
            self.menu.insertMenu(self.paired_menu.menuAction(), m)
            self._request_menus.append(m)
            self.request_actions[r.code] = (accept, deny)
            if r.fingerprint + r.code not in self._notified_keys:
                self._notified_keys.add(r.fingerprint + r.code)
                self.notify("Pairing request",
                            f"“{r.name}” asks to use this PC. Accept only if its screen shows "
                            f"{_spaced(r.code)} (tray menu → Pairing requests).")

    def _fill_paired(self, paired: tuple) -> None:
        key = tuple((p.fingerprint, p.name) for p in paired)
        if key == self._paired_key:
            return
        self._paired_key = key
        self.paired_menu.clear()
        self.revoke_actions = {}
        self.paired_menu.setTitle(f"Paired controllers ({len(paired)})")
        if not paired:
            none = self.paired_menu.addAction("none yet")
            none.setEnabled(False)
        for p in paired:
            a = self.paired_menu.addAction(f"Revoke “{p.name}” ({p.fingerprint[:8]})")
            a.triggered.connect(lambda _=False, fp=p.fingerprint: self.revoke(fp))
            self.revoke_actions[p.fingerprint] = a

    def notify(self, title: str, message: str) -> None:
        self.notified.emit(title, message)
        if QSystemTrayIcon.supportsMessages() and self.icon.isVisible():
            self.icon.showMessage(title, message, tray_icon(self.icon_state), 8000)

    # -- acting -----------------------------------------------------------------------
    def _do(self, fn, *args, name: str) -> None:
        task = self.runner.call(fn, *args, name=name)
        task.failed.connect(lambda exc: self.notify("Flotilla agent", str(exc)))
        task.finished.connect(self.poll)

    def accept(self, code: str) -> None:
        self._do(self.handle.accept, code, name="pair-accept")

    def deny(self, code: str) -> None:
        self._do(self.handle.deny, code, name="pair-deny")

    def revoke(self, fingerprint: str) -> None:
        self._do(self.handle.revoke, fingerprint, name="pair-revoke")

    def _toggle_share_now(self, on: bool) -> None:
        self._do(self.handle.share_now, on, name="share-now")

    def _toggle_pause(self, on: bool) -> None:
        self._do(self.handle.pause, on, name="pause")

    def open_policy(self) -> None:
        task = self.runner.call(self.handle.load_policy, name="policy")
        task.result.connect(self._show_policy)

    def _show_policy(self, policy: dict) -> None:
        self.dialog = dlg = PolicyDialog(policy)
        dlg.accepted.connect(lambda: self._do(self.handle.save_policy, dlg.form.policy(), name="save-policy"))
        dlg.show()
        dlg.raise_()


def run(argv: list[str] | None = None) -> int:
    """`flotilla agent` with a display (the "flotilla.tray" entry point): start
    the agent (`flotilla agent --headless ARGV`) and show its tray icon. Quit
    stops the agent. Without a system tray, the agent just runs (headless)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("Flotilla agent")
    app.setStyle("Fusion")
    app.setQuitOnLastWindowClosed(False)
    style.apply("light")
    app.setStyleSheet(style.STYLESHEET)
    if not QSystemTrayIcon.isSystemTrayAvailable():
        print("flotilla agent: this desktop has no system tray; running without the icon", file=sys.stderr)
        try:
            return client.AgentHandle.spawn(argv).wait()
        except KeyboardInterrupt:
            return 130
    collector = GuiThreadCollector(app)  # cycles holding Qt objects die on this thread only
    collector.start()
    runner = Runner(app, max_threads=4)
    tray = Tray(runner)
    tray.show()
    handle: list[client.AgentHandle] = []

    def started(h: client.AgentHandle) -> None:
        handle.append(h)
        tray.set_handle(h)

    def failed(exc: BaseException) -> None:
        print(f"flotilla agent: {exc}", file=sys.stderr)
        app.exit(1)

    def quit_() -> None:
        tray.icon.hide()
        if handle:
            task = runner.call(handle[0].stop, name="agent-stop")
            task.finished.connect(app.quit)
        else:
            app.quit()

    task = runner.call(client.AgentHandle.spawn, argv, name="agent-start")
    task.result.connect(started)
    task.failed.connect(failed)
    tray.quit_requested.connect(quit_)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: QTimer.singleShot(0, quit_))
    beat = QTimer(interval=250)  # lets Python run its signal handlers while Qt waits
    beat.timeout.connect(lambda: None)
    beat.start()
    code = app.exec()
    if handle:
        handle[0].stop()
    runner.wait_for_done(3000)
    collector.stop()
    return code


if __name__ == "__main__":
    sys.exit(run())

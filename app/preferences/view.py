"""The Settings view: theme, data folder, the local API server, and this PC's
sharing policy (the file the fleet agent reads: engine.client.sharing_policy_path()).

The API server serves whatever engine the session has: it is (re)started in
the background when the engine changes while the switch is on.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QButtonGroup, QCheckBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
    QPushButton, QRadioButton, QSpinBox, QVBoxLayout, QWidget,
)

from app import style
from app.background import Runner
from app.preferences.policy_form import PolicyForm
from app.session import EngineSession
from app.settings import AppSettings
from engine import client


class SettingsView(QWidget):
    theme_chosen = Signal(str)  # "light" | "dark" | "system"
    interfaces_chosen = Signal(str)  # discovery interfaces ("" = all)

    def __init__(self, session: EngineSession, runner: Runner, settings: AppSettings,
                 config: Path, data: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session, self.runner, self.settings, self.config = session, runner, settings, config
        self.server = None  # the running ApiServer
        self._server_engine = None
        self._busy = False
        self._failed_for = None  # (port, engine) whose start failed

        root = style.scrolling_page(self)
        root.addWidget(QLabel("Settings", objectName="title"))

        look = QGroupBox("Appearance")
        ll = QHBoxLayout(look)
        self.theme_group = QButtonGroup(self)
        for name, label in (("system", "System"), ("light", "Light"), ("dark", "Dark")):
            b = QRadioButton(label)
            b.setObjectName(f"theme-{name}")
            b.setChecked(settings.theme == name)
            b.toggled.connect(lambda on, n=name: on and self._choose_theme(n))
            self.theme_group.addButton(b)
            ll.addWidget(b)
        ll.addStretch(1)
        root.addWidget(look)

        data_box = QGroupBox("Data folder")
        dl = QVBoxLayout(data_box)
        self.data_label = QLabel(str(data))
        self.data_label.setWordWrap(True)
        dl.addWidget(self.data_label)
        dl.addWidget(QLabel("Conversations are stored here (SQLite). $FLOTILLA_DATA overrides it.",
                            objectName="hint"))
        drow = QHBoxLayout()
        open_button = QPushButton("Open folder")
        open_button.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(data))))
        change = QPushButton("Change…")
        change.clicked.connect(self._change_data)
        drow.addWidget(open_button)
        drow.addWidget(change)
        drow.addStretch(1)
        dl.addLayout(drow)
        root.addWidget(data_box)

        api = QGroupBox("Local API server (OpenAI-compatible)")
        al = QFormLayout(api)
        al.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        self.api_switch = QCheckBox("Serve the current engine on 127.0.0.1")
        self.api_port = QSpinBox(minimum=1024, maximum=65535, value=settings.api_port)
        self.api_status = QLabel("off", objectName="muted")
        self.api_status.setWordWrap(True)
        al.addRow(self.api_switch)
        al.addRow("Port", self.api_port)
        al.addRow("Status", self.api_status)
        self.api_switch.setChecked(settings.api_enabled)
        self.api_switch.toggled.connect(self._api_toggled)
        self.api_port.editingFinished.connect(self._api_port_changed)
        root.addWidget(api)

        disc = QGroupBox("Finding peers")
        fl = QFormLayout(disc)
        fl.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        self.interfaces = QLineEdit(settings.fleet_interfaces)
        self.interfaces.setPlaceholderText("all interfaces")
        self.interfaces.setAccessibleName("Discovery interfaces")
        self.interfaces.setToolTip("Network interfaces (names like eth0, or IPv4 addresses, comma-separated) "
                                   "where the app looks for agents over mDNS. Empty = all of them.")
        self.interfaces.setMinimumWidth(240)
        self.interfaces.returnPressed.connect(self._apply_interfaces)
        apply_button = QPushButton("Apply")
        apply_button.clicked.connect(self._apply_interfaces)
        irow = QHBoxLayout()
        irow.addWidget(self.interfaces)
        irow.addWidget(apply_button)
        irow.addStretch(1)
        fl.addRow("Look for agents on", irow)
        fl.addRow(QLabel("Where multicast does not reach (guest Wi-Fi, another subnet), add a peer by "
                         "address in the Fleet view.", objectName="hint", wordWrap=True))
        root.addWidget(disc)

        share = QGroupBox("Sharing this PC with the fleet")
        sl = QVBoxLayout(share)
        self.policy_form = PolicyForm()
        # The form's controls, under the names the rest of the view (and the tests) use.
        f = self.policy_form
        self.share_enabled, self.idle_minutes, self.require_ac = f.share_enabled, f.idle_minutes, f.require_ac
        self.max_ram, self.device_checks, self.yield_back = f.max_ram, f.device_checks, f.yield_back
        self.save_policy_button = QPushButton("Save sharing policy", objectName="primary")
        self.save_policy_button.clicked.connect(self.save_policy)
        self.policy_status = QLabel("", objectName="hint")
        self.policy_status.setWordWrap(True)
        sl.addWidget(f)
        save_row = QHBoxLayout()
        save_row.addWidget(self.save_policy_button)
        save_row.addStretch(1)
        sl.addLayout(save_row)
        sl.addWidget(self.policy_status)
        root.addWidget(share)
        root.addStretch(1)

        session.changed.connect(self._sync_api)
        self._load_policy()
        self._sync_api()

    # -- theme / data ------------------------------------------------------------------------
    def _choose_theme(self, name: str) -> None:
        self.settings.theme = name
        self.settings.save(self.config)
        self.theme_chosen.emit(name)

    def _apply_interfaces(self) -> None:
        text = ", ".join(i.strip() for i in self.interfaces.text().split(",") if i.strip())
        self.interfaces.setText(text)
        if text != self.settings.fleet_interfaces:
            self.settings.fleet_interfaces = text
            self.settings.save(self.config)
            self.interfaces_chosen.emit(text)

    def _change_data(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose the data folder")
        if path:
            self.settings.data_folder = path
            self.settings.save(self.config)
            self.data_label.setText(f"{path}  (used from the next start)")

    # -- API server -------------------------------------------------------------------------
    def _api_toggled(self, on: bool) -> None:
        self._failed_for = None
        self.settings.api_enabled = on
        self.settings.save(self.config)
        self._sync_api()

    def _api_port_changed(self) -> None:
        if self.api_port.value() != self.settings.api_port:
            self.settings.api_port = self.api_port.value()
            self.settings.save(self.config)
            self._failed_for = None
            self._stop_server()
            self._sync_api()

    def _sync_api(self) -> None:
        """Make the server match the switch and the engine; idempotent. One
        start or stop runs at a time; when it finishes this runs again."""
        if self._busy:
            return
        want = self.session.engine if self.api_switch.isChecked() and self.session.is_ready else None
        if self.server is not None and self._server_engine is not want:
            self._stop_server()
        elif want is not None and self.server is None and self._failed_for != (self.api_port.value(), want):
            self._busy = True
            self.api_status.setText("starting…")
            task = self.runner.call(client.start_api_server, want, self.api_port.value(), name="api")
            task.result.connect(lambda srv: self._started(srv, want))
            task.failed.connect(lambda exc: self._start_failed(exc, want))
            task.finished.connect(self._done)
        elif self.server is not None:
            self.api_status.setText(f"serving {self.session.label()} at {self.server.url}/v1")
        elif not self.api_switch.isChecked():
            self.api_status.setText("off")
        elif self._failed_for is not None:
            pass  # keep the reason until the user changes the port, the switch or the engine
        else:
            self.api_status.setText("waiting for an engine (open one from Models or Plan)")

    def _started(self, server, engine) -> None:
        self.server, self._server_engine = server, engine

    def _start_failed(self, exc: BaseException, engine) -> None:
        self._failed_for = (self.api_port.value(), engine)  # do not retry the same thing
        self.api_status.setText(f"cannot start on port {self.api_port.value()}: {exc}")

    def _done(self) -> None:
        self._busy = False
        self._sync_api()

    def _stop_server(self) -> None:
        server, self.server, self._server_engine = self.server, None, None
        if server is None:
            return
        self._busy = True
        self.api_status.setText("stopping…")
        task = self.runner.call(server.stop, name="api-stop")
        task.finished.connect(self._done)

    def shutdown(self) -> None:
        if self.server is not None:
            self._stop_server()

    # -- sharing policy ----------------------------------------------------------------------
    def _load_policy(self) -> None:
        task = self.runner.call(client.load_sharing_policy, name="policy")
        task.result.connect(self._show_policy)
        task.failed.connect(lambda exc: self.policy_status.setText(f"Cannot read the policy: {exc}"))

    def _show_policy(self, p: dict) -> None:
        self.policy_form.set_policy(p)

    def policy(self) -> dict:
        return self.policy_form.policy()

    def save_policy(self) -> None:
        task = self.runner.call(client.save_sharing_policy, self.policy(), name="save-policy")
        task.result.connect(lambda path: self.policy_status.setText(
            f"Saved to {path}. The fleet agent reads this file and applies it when it changes."))
        task.failed.connect(lambda exc: self.policy_status.setText(f"Not saved: {exc}"))

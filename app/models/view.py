"""The Models view: what this PC can run, and getting more.

The list (demo models, the Hugging Face cache, added folders, OpenVINO IR)
comes from engine.client.list_models in the background; each built model is
then profiled (layers, experts) one at a time in the background, so a big
folder never holds the list back. Download, import and convert each run as
one background job with a progress bar; a download can be paused (the job
stops at its next progress tick; huggingface_hub keeps the partial files)
and resumed. This machine is offline: the download then ends with the
hub's reason in plain words.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QProgressBar,
    QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from app.background import Runner
from app.session import EngineSession
from engine import client

COLUMNS = ["Model", "Kind", "Size", "Architecture", "Layers", "Experts", "Status"]
KIND_NAMES = {"demo": "demo", "hub": "HF cache", "hf": "folder", "openvino": "OpenVINO IR"}


def _size(n: int) -> str:
    return "—" if not n else f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


class ModelsView(QWidget):
    plan_requested = Signal(str)  # model spec: open it in the plan editor

    def __init__(self, session: EngineSession, runner: Runner, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session, self.runner = session, runner
        self.entries: list = []
        self.profiles: dict[str, object] = {}  # model spec -> ModelProfile
        self._pause: threading.Event | None = None
        self._download_id = ""

        root = QVBoxLayout(self)
        root.setContentsMargins(24, 18, 24, 18)
        head = QHBoxLayout()
        head.addWidget(QLabel("Models", objectName="title"))
        head.addStretch(1)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.import_button = QPushButton("Import folder…")
        self.import_button.setToolTip("Add a Hugging Face or OpenVINO IR model folder from disk")
        self.import_button.clicked.connect(self._pick_folder)
        head.addWidget(self.refresh_button)
        head.addWidget(self.import_button)
        root.addLayout(head)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setAccessibleName("Local models")
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setTabKeyNavigation(False)  # Tab leaves the table, arrows move inside
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._sync_buttons)
        root.addWidget(self.table, 1)

        actions = QHBoxLayout()
        self.chat_button = QPushButton("Chat with it", objectName="primary")
        self.chat_button.setToolTip("Open the selected model on the local engine")
        self.chat_button.clicked.connect(self._chat_selected)
        self.plan_button = QPushButton("Plan with it")
        self.plan_button.clicked.connect(lambda: self.plan_requested.emit(self.selected_spec() or ""))
        self.convert_button = QPushButton("Convert to OpenVINO")
        self.convert_button.clicked.connect(self.convert_selected)
        for b in (self.chat_button, self.plan_button, self.convert_button):
            actions.addWidget(b)
        actions.addStretch(1)
        root.addLayout(actions)

        root.addWidget(QLabel("Download from the Hugging Face hub", objectName="section"))
        dl = QHBoxLayout()
        self.hub_id = QLineEdit()
        self.hub_id.setPlaceholderText("Hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct")
        self.hub_id.setAccessibleName("Hub model id")
        self.hub_id.returnPressed.connect(self.start_download)
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self.start_download)
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(self.pause_download)
        self.resume_button = QPushButton("Resume")
        self.resume_button.clicked.connect(self.resume_download)
        for w in (self.hub_id, self.download_button, self.pause_button, self.resume_button):
            dl.addWidget(w)
        root.addLayout(dl)
        self.job_bar = QProgressBar()
        self.job_bar.setRange(0, 1000)
        self.job_bar.setTextVisible(False)
        self.job_label = QLabel("", objectName="muted")
        self.job_label.setWordWrap(True)
        self.job_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        root.addWidget(self.job_bar)
        root.addWidget(self.job_label)
        self._set_download_state("idle")
        self._sync_buttons()
        self.refresh()

    # -- list ---------------------------------------------------------------------------
    def refresh(self) -> None:
        task = self.runner.call(client.list_models, name="list-models")
        task.result.connect(self._show)
        task.failed.connect(lambda exc: self.job_label.setText(f"Cannot list models: {exc}"))

    def _show(self, entries: list) -> None:
        self.entries = entries
        current = self.selected_spec()
        self.table.setRowCount(len(entries))
        for row, e in enumerate(entries):
            status = e.error or ("ready" if e.built else "built on first use")
            values = [e.model_id, KIND_NAMES.get(e.kind, e.kind), _size(e.size_bytes),
                      e.architecture or "unknown", "…", "…", status]
            for col, v in enumerate(values):
                item = QTableWidgetItem(v)
                if e.error:
                    item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEnabled)
                    item.setToolTip(e.error)
                self.table.setItem(row, col, item)
            if e.model_id == current:
                self.table.selectRow(row)
        if self.table.currentRow() < 0 and entries:
            self.table.selectRow(0)
        self._profile_next([e for e in entries if e.built and not e.error])

    def _profile_next(self, todo: list) -> None:
        # One profile at a time: a large folder reads safetensors headers.
        while todo and self._spec_of(todo[0]) in self.profiles:
            self._fill_profile(todo.pop(0))
        if not todo:
            return
        entry = todo.pop(0)
        spec = self._spec_of(entry)
        task = self.runner.call(client.model_profile, spec, name="profile")
        task.result.connect(lambda prof: (self.profiles.__setitem__(spec, prof), self._fill_profile(entry)))
        task.failed.connect(lambda exc: self._set_cell(entry, 6, f"cannot inspect: {exc}"))
        task.finished.connect(lambda: self._profile_next(todo))

    def _fill_profile(self, entry) -> None:
        prof = self.profiles.get(self._spec_of(entry))
        if prof is None:
            return
        self._set_cell(entry, 4, str(prof.num_layers))
        ex = prof.experts
        self._set_cell(entry, 5, f"{ex.num_experts} (top-{ex.top_k})" if ex else "dense")

    def _set_cell(self, entry, col: int, text: str) -> None:
        if entry in self.entries:
            item = self.table.item(self.entries.index(entry), col)
            if item is not None:
                item.setText(text)

    @staticmethod
    def _spec_of(entry) -> str:
        # Demos and hub models resolve by id; folders by their path.
        return entry.model_id if entry.kind in ("demo", "hub") else str(entry.path)

    def selected_entry(self):
        row = self.table.currentRow()
        return self.entries[row] if 0 <= row < len(self.entries) else None

    def selected_spec(self) -> str | None:
        e = self.selected_entry()
        return self._spec_of(e) if e is not None else None

    def _sync_buttons(self) -> None:
        e = self.selected_entry()
        usable = e is not None and not e.error
        self.chat_button.setEnabled(usable)
        self.plan_button.setEnabled(usable)
        convertible = usable and e.kind in ("hf", "hub") and self._download_id == ""
        self.convert_button.setEnabled(convertible)
        if e is not None and e.kind == "openvino":
            self.convert_button.setToolTip("Already an OpenVINO IR folder")
        elif e is not None and e.kind == "demo":
            self.convert_button.setToolTip("Demo models are converted automatically when opened")
        else:
            self.convert_button.setToolTip("Export the selected Hugging Face model to OpenVINO IR")

    def _chat_selected(self) -> None:
        spec = self.selected_spec()
        if spec:
            self.session.open(spec, "local")

    # -- import / convert --------------------------------------------------------------------
    def _pick_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Import a model folder")
        if path:
            self.import_folder(path)

    def import_folder(self, path: str) -> None:
        self.job_label.setText(f"Checking {path}…")
        task = self.runner.call(client.import_model_folder, path, name="import")
        task.result.connect(lambda e: (self.job_label.setText(f"Added {e.model_id} ({_size(e.size_bytes)})"),
                                       self.refresh()))
        task.failed.connect(lambda exc: self.job_label.setText(f"Cannot import {path}: {exc}"))

    def convert_selected(self) -> None:
        spec = self.selected_spec()
        if not spec:
            return
        self.convert_button.setEnabled(False)
        self.job_bar.setValue(0)
        task = self.runner.call(client.convert_to_openvino, spec, report_to="progress", name="convert")
        task.item.connect(self._on_progress)
        task.result.connect(lambda path: self.job_label.setText(f"Converted: {path}"))
        task.failed.connect(lambda exc: self.job_label.setText(f"Conversion failed: {exc}"))
        task.finished.connect(self._sync_buttons)

    # -- download ----------------------------------------------------------------------------
    def _set_download_state(self, state: str) -> None:
        """idle | running | paused"""
        self.download_button.setEnabled(state == "idle")
        self.hub_id.setEnabled(state == "idle")
        self.pause_button.setEnabled(state == "running")
        self.resume_button.setEnabled(state == "paused")
        self.pause_button.setToolTip("Pause the download (partial files are kept)")
        self.resume_button.setToolTip("Resume where the download stopped" if state == "paused"
                                      else "Nothing is paused")

    def start_download(self) -> None:
        hub_id = self.hub_id.text().strip()
        if not hub_id or self._download_id:
            return
        self._download_id = hub_id
        self._run_download()

    def _run_download(self) -> None:
        hub_id = self._download_id
        self._pause = pause = threading.Event()
        self._set_download_state("running")
        self.job_label.setText(f"Downloading {hub_id}…")
        task = self.runner.call(client.download_model, hub_id, report_to="progress", pause=pause,
                                name="download")
        task.item.connect(self._on_progress)
        task.result.connect(lambda path: self._download_done(f"Downloaded {hub_id} to {path}"))
        task.failed.connect(self._download_failed)

    def pause_download(self) -> None:
        if self._pause is not None:
            self._pause.set()
            self.pause_button.setEnabled(False)
            self.job_label.setText("Pausing…")

    def resume_download(self) -> None:
        if self._download_id:
            self._run_download()

    def _download_failed(self, exc: BaseException) -> None:
        if isinstance(exc, client.DownloadPaused):
            self._set_download_state("paused")
            self.job_label.setText(f"Paused {self._download_id}. Resume continues from the partial files.")
            return
        self._download_done(f"Download failed: {exc}", error=True)

    def _download_done(self, text: str, error: bool = False) -> None:
        self._download_id = ""
        self._pause = None
        self._set_download_state("idle")
        self.job_label.setObjectName("error" if error else "muted")
        self.job_label.setStyleSheet("")  # re-polish for the new object name
        self.job_label.setText(text)
        if not error:
            self.job_bar.setValue(1000)
            self.refresh()

    def _on_progress(self, values: tuple) -> None:
        message, fraction = (list(values) + ["", 0.0])[:2]
        self.job_bar.setValue(int(1000 * max(0.0, min(1.0, float(fraction or 0)))))
        if message:
            self.job_label.setText(str(message))

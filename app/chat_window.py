"""The Flotilla main window: pick a model, chat with it, watch it stream.

Every engine call (open, submit + stream, cancel, close, listing models) runs
through app.background.Runner, so the GUI thread only ever paints and reacts
to signals. The window is a small state machine:

    opening --ok--> ready --send--> answering --final event--> ready
       \\--error--> failed (pick a model to retry)        any --close--> closing

The engine is reached only through engine.client (the facade) and the typed
messages of engine.protocol.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QComboBox, QHBoxLayout, QLabel, QMainWindow, QMessageBox, QProgressBar, QPushButton,
    QVBoxLayout, QWidget,
)

from app import style
from app.background import Runner
from app.chat_view import ChatView
from app.conversation import CANCELLED, DONE, ERROR, Conversation
from app.prompt_edit import PromptEdit
from engine import client
from engine.protocol.messages import GenerateRequest, SamplingParams, TokenEvent

OPENING, READY, ANSWERING, FAILED, CLOSING = "opening", "ready", "answering", "failed", "closing"
CLOSE_GRACE_MS = 10_000  # give up waiting for the engine to close after this


def _stream_request(engine: client.Engine, request: GenerateRequest,
                    stop: threading.Event) -> Iterator[TokenEvent]:
    """Worker side of one answer: submit, then yield events until the final one.
    Stop may be pressed before submit() returns; honour it right after."""
    request_id = engine.submit(request)
    if stop.is_set():
        engine.cancel(request_id)
    yield from engine.stream(request_id)


def _open(spec: str, device: str, progress) -> tuple[client.Engine, client.EngineInfo]:
    engine = client.open_engine(spec, device=device, progress=progress)
    return engine, engine.info  # read info here too: it is an engine call


class ChatWindow(QMainWindow):
    state_changed = Signal(str)  # one of the state names above (tests wait on it)
    shut_down = Signal()  # the engine is closed; the window may go away

    def __init__(self, spec: str = "demo", device: str = "CPU",
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Flotilla")
        self.setWindowIcon(style.app_icon())
        self.resize(1000, 720)
        self.setMinimumSize(QSize(640, 480))

        self.device = device
        self.sampling = SamplingParams(max_tokens=256)  # greedy; tests may shorten it
        self.conversation = Conversation()
        self.runner = Runner(self)
        self.runner.idle.connect(self._finish_shutdown_when_idle)
        self.engine: client.Engine | None = None
        self.info: client.EngineInfo | None = None
        self.state = OPENING
        self.last_request: GenerateRequest | None = None  # the latest one sent
        self.last_events: list[TokenEvent] = []  # events of the latest answer
        self._spec = spec
        self._open_generation = 0  # ignore the result of a superseded open
        self._request_id: str | None = None
        self._stop = threading.Event()
        self._is_shut_down = False
        self._error_box: QMessageBox | None = None

        self._build_ui()
        self._list_models()
        self.open_model(spec)

    # -- layout ----------------------------------------------------------------------
    def _build_ui(self) -> None:
        central = QWidget(objectName="central")
        root = QVBoxLayout(central)
        root.setContentsMargins(0, 0, 0, 0)
        root.setSpacing(0)

        top = QWidget(objectName="topBar")
        top_l = QHBoxLayout(top)
        top_l.setContentsMargins(16, 10, 16, 10)
        top_l.setSpacing(10)
        logo = QLabel()
        logo.setPixmap(style.app_icon().pixmap(28, 28))
        title = QLabel("Flotilla", objectName="title")
        model_label = QLabel("Model", objectName="muted")
        self.model_box = QComboBox()
        self.model_box.addItem(self._spec)
        self.model_box.setToolTip("The model that answers. Demo models are tiny and random: "
                                  "they show the plumbing, not intelligence.")
        self.model_box.activated.connect(self._on_model_chosen)
        self.new_chat_button = QPushButton("New chat")
        self.new_chat_button.setToolTip("Forget the conversation and start over")
        self.new_chat_button.clicked.connect(self.new_chat)
        top_l.addWidget(logo)
        top_l.addWidget(title)
        top_l.addStretch(1)
        top_l.addWidget(model_label)
        top_l.addWidget(self.model_box)
        top_l.addWidget(self.new_chat_button)

        self.chat_view = ChatView(self.conversation)

        bar = QWidget(objectName="inputBar")
        bar_l = QHBoxLayout(bar)
        bar_l.setContentsMargins(16, 12, 16, 12)
        bar_l.setSpacing(10)
        self.prompt = PromptEdit()
        self.prompt.submitted.connect(self.send)
        self.send_button = QPushButton("Send", objectName="send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.setShortcut(Qt.Key.Key_Escape)
        self.stop_button.clicked.connect(self.stop)
        buttons = QVBoxLayout()
        buttons.setSpacing(6)
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        bar_l.addWidget(self.prompt, 1)
        bar_l.addLayout(buttons)

        root.addWidget(top)
        root.addWidget(self.chat_view, 1)
        root.addWidget(bar)
        self.setCentralWidget(central)

        self.status_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.statusBar().setSizeGripEnabled(False)
        self.statusBar().addWidget(self.status_label, 1)
        self.statusBar().addPermanentWidget(self.progress)
        self.prompt.setFocus()

    # -- state ---------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        self.state = state
        ready = state == READY
        self.prompt.setEnabled(ready or state in (OPENING, FAILED))  # typing ahead is fine
        self.send_button.setEnabled(ready)
        self.stop_button.setEnabled(state == ANSWERING)
        self.model_box.setEnabled(state in (READY, FAILED))
        self.new_chat_button.setEnabled(state in (READY, FAILED) and bool(self.conversation.turns))
        self.progress.setVisible(state == OPENING)
        if ready:
            self.prompt.setFocus()
        self.state_changed.emit(state)

    def _set_status(self, text: str, error: bool = False) -> None:
        self.status_label.setText(text)
        self.status_label.setStyleSheet(f"color: {style.ERROR};" if error else "")

    def _ready_text(self) -> str:
        info = self.info
        return f"{info.model_id} · {info.device} · ready" if info else "ready"

    # -- opening a model -------------------------------------------------------------------
    def _list_models(self) -> None:
        task = self.runner.call(client.list_demo_models)
        task.result.connect(self._on_models_listed)
        # A missing list is not worth an error dialog: the current model still works.
        task.failed.connect(lambda exc: None)

    def _on_models_listed(self, ids: list[str]) -> None:
        current = self.model_box.currentText()
        self.model_box.blockSignals(True)
        self.model_box.clear()
        self.model_box.addItems(ids if current in ids else [current, *ids])
        self.model_box.setCurrentText(current)
        self.model_box.blockSignals(False)

    def _on_model_chosen(self, index: int) -> None:
        spec = self.model_box.itemText(index)
        if spec != self._spec or self.state == FAILED:
            self.open_model(spec)

    def open_model(self, spec: str) -> None:
        """Close the current engine (in the background) and open `spec`."""
        if self.engine is not None:
            self._close_engine_async(self.engine)
            self.engine = self.info = None
        self._spec = spec
        self._open_generation += 1
        generation = self._open_generation
        self._set_status(f"Loading {spec}…")
        self.progress.setValue(0)
        self._set_state(OPENING)
        task = self.runner.call(_open, spec, self.device, report_to="progress", name="open")
        task.item.connect(self._on_open_progress)
        task.result.connect(lambda res: self._on_opened(generation, res))
        task.failed.connect(lambda exc: self._on_open_failed(generation, exc))

    def _on_open_progress(self, values: tuple) -> None:
        if self.state != OPENING:
            return
        message, fraction = (list(values) + ["", 0.0])[:2]
        self._set_status(f"Loading {self._spec}… {message}".rstrip())
        self.progress.setValue(int(max(0.0, min(1.0, float(fraction or 0.0))) * 100))

    def _on_opened(self, generation: int, res: tuple) -> None:
        engine, info = res
        if generation != self._open_generation or self.state == CLOSING:
            self._close_engine_async(engine)  # superseded, or the user is leaving
            return
        self.engine, self.info = engine, info
        self._set_status(self._ready_text())
        self._set_state(READY)

    def _on_open_failed(self, generation: int, exc: BaseException) -> None:
        if generation != self._open_generation:
            return
        if self.state == CLOSING:
            return  # Runner.idle finishes the shutdown
        reason = str(exc) or type(exc).__name__
        self._set_status(f"Could not open {self._spec}: {reason}", error=True)
        self._set_state(FAILED)
        self._show_error(f"Could not open the model “{self._spec}”.", reason)

    def _show_error(self, text: str, detail: str) -> None:
        # open(), not exec(): a nested event loop would stall streaming and tests.
        box = QMessageBox(QMessageBox.Icon.Warning, "Flotilla", text,
                          QMessageBox.StandardButton.Ok, self)
        box.setInformativeText(detail)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()
        self._error_box = box

    # -- chatting ---------------------------------------------------------------------------
    def send(self) -> None:
        text = self.prompt.text().strip()
        if self.state != READY or not text or self.engine is None:
            return
        self.prompt.clear()
        self.conversation.add_user(text)
        answer = self.conversation.start_answer()
        request = GenerateRequest(
            request_id=f"chat-{uuid.uuid4().hex[:12]}",
            messages=self.conversation.messages(),  # the whole conversation so far
            sampling=self.sampling,
        )
        self.last_request = request
        self._request_id = request.request_id
        self._stop = threading.Event()
        self.last_events = []
        self._set_status(f"{self._ready_text().removesuffix(' · ready')} · answering…")
        self._set_state(ANSWERING)
        self.chat_view.render_now()

        task = self.runner.iterate(_stream_request, self.engine, request, self._stop, name="stream")
        task.item.connect(lambda ev: self._on_event(answer, ev))
        task.failed.connect(lambda exc: self._on_stream_failed(answer, exc))
        task.finished.connect(lambda: self._on_stream_finished(answer))

    def stop(self) -> None:
        """Cancel the running answer; the engine ends it with a 'cancelled' event."""
        if self.state != ANSWERING or self._request_id is None or self.engine is None:
            return
        self._stop.set()
        self.stop_button.setEnabled(False)
        self._set_status("Stopping…")
        task = self.runner.call(self.engine.cancel, self._request_id, name="cancel")
        # Unknown id = the answer already ended or is not submitted yet (the
        # stream worker cancels right after submit): nothing to report.
        task.failed.connect(lambda exc: None)

    def new_chat(self) -> None:
        if self.state in (READY, FAILED):
            self.conversation.clear()
            self.chat_view.render_now()
            self._set_state(self.state)

    def _on_event(self, answer, event: TokenEvent) -> None:
        self.last_events.append(event)
        answer.text += event.text
        if event.final:
            self._finish_answer(answer, event)
            self.chat_view.render_now()
        else:
            self.chat_view.schedule_render()

    def _finish_answer(self, answer, event: TokenEvent) -> None:
        reason = event.finish_reason
        if reason == "error":
            answer.state = ERROR
            answer.note = event.error or "the engine failed"
            self._set_status(f"Error: {answer.note}", error=True)
            return
        answer.state = CANCELLED if reason == "cancelled" else DONE
        stats = []
        if event.usage is not None:
            stats.append(f"{event.usage.completion_tokens} tokens")
        if event.timings is not None:
            stats.append(f"{event.timings.ttft_s:.2f} s to first token")
            if event.timings.decode_tok_s > 0:
                stats.append(f"{event.timings.decode_tok_s:.1f} tok/s")
        if reason == "cancelled":
            stats.insert(0, "stopped")
        elif reason == "length":
            stats.insert(0, "cut at the token limit")
        answer.note = " · ".join(stats)
        perf = [s for s in stats if "first token" in s or "tok/s" in s]
        self._set_status(" — ".join([self._ready_text(), " · ".join(perf)]) if perf
                         else self._ready_text())

    def _on_stream_failed(self, answer, exc: BaseException) -> None:
        if answer.state in (DONE, CANCELLED, ERROR):
            return
        answer.state = ERROR
        answer.note = str(exc) or type(exc).__name__
        self._set_status(f"Error: {answer.note}", error=True)

    def _on_stream_finished(self, answer) -> None:
        if answer.state not in (DONE, CANCELLED, ERROR):
            # The stream ended without a final event (engine closed under us).
            answer.state = ERROR
            answer.note = answer.note or "the answer ended unexpectedly"
        self._request_id = None
        self.chat_view.render_now()
        if self.state == ANSWERING:
            self._set_state(READY)

    # -- shutdown -----------------------------------------------------------------------------
    def _close_engine_async(self, engine: client.Engine) -> None:
        task = self.runner.call(engine.close, name="close")
        task.failed.connect(lambda exc: None)  # closing is best effort

    def shutdown(self) -> None:
        """Stop any answer, close the engine off the GUI thread, then emit
        shut_down. Safe to call more than once."""
        if self.state == CLOSING or self._is_shut_down:
            return
        self._set_status("Closing…")
        was_answering = self.state == ANSWERING
        if was_answering and self.engine is not None and self._request_id:
            self._stop.set()
            self.runner.call(self.engine.cancel, self._request_id).failed.connect(lambda exc: None)
        self._set_state(CLOSING)
        self.prompt.setEnabled(False)
        if self.engine is not None:
            engine, self.engine = self.engine, None
            self._close_engine_async(engine)
        # Never hang the exit on a stuck engine.
        QTimer.singleShot(CLOSE_GRACE_MS, self._force_shutdown)
        self._finish_shutdown_when_idle()

    def _finish_shutdown_when_idle(self) -> None:
        # Called on Runner.idle and once from shutdown(): the engine close and
        # any answer or open still in flight must all have returned.
        if self.state == CLOSING and not self._is_shut_down and self.runner.active() == 0:
            self._force_shutdown()

    def _force_shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.shut_down.emit()
        self.close()

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt name
        if self._is_shut_down:
            event.accept()
            return
        # First close: keep the window until the engine is closed in the background.
        event.ignore()
        self.shutdown()

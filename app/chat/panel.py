"""One conversation: transcript, prompt, stop/regenerate/edit, system prompt,
sampling settings and a banner for engine failures.

The panel streams through the shared EngineSession's engine on the Runner;
several panels (the Chat view and detached windows) can stream at once on the
same engine, which interleaves them. Every streamed token batch is written to
the ChatStore when the transcript repaints, so a crash loses at most the last
~40 ms of an answer and nothing that was shown.
"""

from __future__ import annotations

import html
import threading
import uuid
from collections.abc import Iterator

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication, QComboBox, QDoubleSpinBox, QFormLayout, QFrame, QHBoxLayout, QLabel, QPlainTextEdit,
    QPushButton, QSpinBox, QVBoxLayout, QWidget,
)

from app.background import Runner
from app.chat.transcript import ChatView
from app.chat.conversation import CANCELLED, DONE, ERROR, STREAMING, Conversation, Turn
from app.chat.prompt_edit import PromptEdit
from app.session import EngineSession
from app.chat.store import ChatStore
from engine import client
from engine.protocol.messages import GenerateRequest, SamplingParams, SpeculativeParams, TokenEvent

SAVE_MS = 40  # a streamed batch is saved and painted at most this often
TITLE_CHARS = 48


def _stream_request(engine: client.Engine, request: GenerateRequest,
                    stop: threading.Event) -> Iterator[TokenEvent]:
    """Worker side of one answer: submit, then yield events until the final one.
    Stop may be pressed before submit() returns; honour it right after."""
    request_id = engine.submit(request)
    if stop.is_set():
        engine.cancel(request_id)
    yield from engine.stream(request_id)


def load_conversation(store: ChatStore, cid: str) -> Conversation:
    meta = store.get(cid)
    conv = Conversation(meta.system_prompt if meta else None, cid, meta.title if meta else "New chat")
    for m in store.messages(cid):
        conv.turns.append(Turn(m.role, m.text, m.state, m.note, m.stats, m.id))
    return conv


class ChatPanel(QWidget):
    answering_changed = Signal(bool)  # an answer started (True) or ended (False)
    title_changed = Signal(str, str)  # (conversation id, title)
    detach_requested = Signal(str)  # conversation id

    def __init__(self, session: EngineSession, store: ChatStore, runner: Runner,
                 detachable: bool = True, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.store = store
        self.runner = runner
        self.conversation = Conversation()
        self.sampling = SamplingParams(max_tokens=256)  # greedy by default: reproducible
        self.last_request: GenerateRequest | None = None
        self.last_events: list[TokenEvent] = []
        self._answer: Turn | None = None
        self._request_id: str | None = None
        self._engine_used: client.Engine | None = None
        self._stop = threading.Event()
        self._flush = QTimer(self, singleShot=True, interval=SAVE_MS)
        self._flush.timeout.connect(self._save_and_paint)
        self._build(detachable)
        session.changed.connect(self._sync)
        session.load_changed.connect(self._sync)
        self._sync()

    # -- layout ---------------------------------------------------------------------
    def _build(self, detachable: bool) -> None:
        root = QVBoxLayout(self)
        root.setContentsMargins(0, 0, 0, 0)
        root.setSpacing(0)

        top = QWidget(objectName="topBar")
        top_l = QHBoxLayout(top)
        top_l.setContentsMargins(16, 8, 16, 8)
        self.title_label = QLabel("New chat", objectName="section")
        self.engine_label = QLabel("", objectName="muted")
        self.system_button = QPushButton("System prompt", checkable=True)
        self.system_button.setToolTip("Instructions sent before the conversation (never shown as a turn)")
        self.sampling_button = QPushButton("Sampling", checkable=True)
        self.sampling_button.setToolTip("Temperature, top-p, token limit, seed")
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.setToolTip("Answer the last message again (Ctrl+R)")
        self.regen_button.clicked.connect(self.regenerate)
        self.detach_button = QPushButton("Detach")
        self.detach_button.setToolTip("Detach this conversation into its own window (Ctrl+Shift+N)")
        self.detach_button.clicked.connect(lambda: self.detach_requested.emit(self.ensure_saved()))
        self.detach_button.setVisible(detachable)
        top_l.addWidget(self.title_label)
        top_l.addWidget(self.engine_label, 1)
        self.engine_label.setMinimumWidth(60)
        for b in (self.system_button, self.sampling_button, self.regen_button, self.detach_button):
            top_l.addWidget(b)

        self.settings_box = QWidget(objectName="topBar")
        sl = QHBoxLayout(self.settings_box)
        sl.setContentsMargins(16, 6, 16, 8)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setPlaceholderText("System prompt, e.g. “You are a concise assistant.”")
        self.system_edit.setTabChangesFocus(True)
        self.system_edit.setFixedHeight(self.fontMetrics().lineSpacing() * 3 + 20)
        self.system_edit.textChanged.connect(self._on_system_changed)
        self.system_edit.setVisible(False)
        self.sampling_form = QWidget()
        form = QFormLayout(self.sampling_form)
        form.setContentsMargins(0, 0, 0, 0)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.top_p = QDoubleSpinBox(minimum=0.05, maximum=1.0, singleStep=0.05, decimals=2, value=1.0)
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=256)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1, value=-1, specialValueText="random")
        form.addRow("Temperature (0 = greedy)", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Max new tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        self.spec_box = QComboBox()
        self.spec_box.setAccessibleName("Speculative decoding")
        for label, mode in (("Engine default", "default"), ("Off", "off"), ("Draft model", "draft"),
                            ("Prompt lookup", "lookup")):
            self.spec_box.addItem(label, mode)
        self.spec_box.setToolTip("Speculative decoding for this conversation's answers (local dense and "
                                 "pipeline engines; the answer is the same, only faster or slower)")
        form.addRow("Speculative", self.spec_box)
        for w in (self.temperature, self.top_p, self.max_tokens, self.seed):
            w.valueChanged.connect(self._on_sampling_changed)
        self.spec_box.currentIndexChanged.connect(self._on_sampling_changed)
        self.sampling_form.setVisible(False)
        sl.addWidget(self.system_edit, 2)
        sl.addWidget(self.sampling_form, 1)
        self.settings_box.setVisible(False)
        self.system_button.toggled.connect(self._toggle_settings)
        self.sampling_button.toggled.connect(self._toggle_settings)

        self.banner = QFrame(objectName="banner")
        bl = QHBoxLayout(self.banner)
        bl.setContentsMargins(12, 8, 8, 8)
        self.banner_label = QLabel(wordWrap=True)
        self.banner_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.banner_local = QPushButton("Use the local engine")
        self.banner_local.clicked.connect(self._use_local)
        dismiss = QPushButton("Dismiss")
        dismiss.clicked.connect(self.banner.hide)
        bl.addWidget(self.banner_label, 1)
        bl.addWidget(self.banner_local)
        bl.addWidget(dismiss)
        self.banner.hide()
        banner_wrap = QWidget()
        bw = QVBoxLayout(banner_wrap)
        bw.setContentsMargins(16, 8, 16, 0)
        bw.addWidget(self.banner)

        self.chat_view = ChatView(self.conversation)
        self.chat_view.action.connect(self._on_action)

        bar = QWidget(objectName="inputBar")
        bar_l = QHBoxLayout(bar)
        bar_l.setContentsMargins(16, 10, 16, 10)
        self.prompt = PromptEdit()
        self.prompt.setAccessibleName("Message")
        self.prompt.submitted.connect(self.send)
        self.send_button = QPushButton("Send", objectName="send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.clicked.connect(self.stop)
        buttons = QVBoxLayout()
        buttons.setSpacing(6)
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        bar_l.addWidget(self.prompt, 1)
        bar_l.addLayout(buttons)

        root.addWidget(top)
        root.addWidget(self.settings_box)
        root.addWidget(banner_wrap)
        root.addWidget(self.chat_view, 1)
        root.addWidget(bar)
        ctx = Qt.ShortcutContext.WidgetWithChildrenShortcut
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self.stop, context=ctx)
        QShortcut(QKeySequence("Ctrl+R"), self, self.regenerate, context=ctx)
        QShortcut(QKeySequence("Ctrl+Shift+N"), self,
                  lambda: self.detach_button.isVisible() and self.detach_button.click(), context=ctx)
        self.setTabOrder(self.prompt, self.send_button)
        self.setTabOrder(self.send_button, self.stop_button)
        self.setFocusProxy(self.prompt)

    def _set_title(self, title: str) -> None:
        # Elided with "…" (a QLabel would just cut it), the whole title in the tooltip.
        fm = self.title_label.fontMetrics()
        text = fm.elidedText(title, Qt.TextElideMode.ElideRight, fm.averageCharWidth() * 28)
        self.title_label.setText(text)
        self.title_label.setMinimumWidth(fm.horizontalAdvance(text) + 4)  # never cut mid-letter
        self.title_label.setToolTip(title)

    def _toggle_settings(self) -> None:
        self.system_edit.setVisible(self.system_button.isChecked())
        self.sampling_form.setVisible(self.sampling_button.isChecked())
        self.settings_box.setVisible(self.system_button.isChecked() or self.sampling_button.isChecked())

    # -- state ------------------------------------------------------------------------
    @property
    def answering(self) -> bool:
        return self._answer is not None

    def _sync(self) -> None:
        ready = self.session.is_ready
        self.send_button.setEnabled(ready and not self.answering)
        self.stop_button.setEnabled(self.answering)
        last = self.conversation.turns[-1] if self.conversation.turns else None
        self.regen_button.setEnabled(ready and not self.answering and last is not None
                                     and last.role == "assistant")
        if self.session.state == "ready":
            load = self.session.load_text()
            self.engine_label.setText(f"  {self.session.label()}" + (f" · {load}" if load else ""))
            self.send_button.setToolTip("Send (Enter)")
        else:
            why = {"opening": "the engine is starting", "failed": f"no engine: {self.session.error}",
                   "closing": "the app is closing"}.get(self.session.state, "no engine is open")
            self.engine_label.setText(f"  {why}")
            self.send_button.setToolTip(f"Cannot send: {why}")

    def restyle(self) -> None:
        self.chat_view.restyle()

    # -- conversations ----------------------------------------------------------------
    def show_conversation(self, conversation: Conversation) -> None:
        if self.answering:
            self.stop()
        self.conversation = conversation
        self.chat_view.set_conversation(conversation)
        self._set_title(conversation.title)
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(conversation.system_prompt or "")
        self.system_edit.blockSignals(False)
        if conversation.id:
            meta = self.store.get(conversation.id)
            if meta and meta.sampling:
                self._load_sampling(meta.sampling)
        self.banner.hide()
        self._sync()

    def ensure_saved(self) -> str:
        """The conversation's store id (creating the row on first use)."""
        if self.conversation.id is None:
            self.conversation.id = self.store.create(self.conversation.title,
                                                     self.conversation.system_prompt or "",
                                                     self._sampling_dict())
        return self.conversation.id

    def _on_system_changed(self) -> None:
        self.conversation.system_prompt = self.system_edit.toPlainText().strip() or None
        if self.conversation.id:
            self.store.update_conversation(self.conversation.id,
                                           system_prompt=self.conversation.system_prompt or "")

    def _sampling_dict(self) -> dict:
        return {"temperature": self.temperature.value(), "top_p": self.top_p.value(),
                "max_tokens": self.max_tokens.value(), "seed": self.seed.value(),
                "speculative": self.spec_box.currentData()}

    def _load_sampling(self, d: dict) -> None:
        for key, box in (("temperature", self.temperature), ("top_p", self.top_p),
                         ("max_tokens", self.max_tokens), ("seed", self.seed)):
            if key in d:
                box.blockSignals(True)
                box.setValue(d[key])
                box.blockSignals(False)
        i = self.spec_box.findData(d.get("speculative", "default"))
        self.spec_box.blockSignals(True)
        self.spec_box.setCurrentIndex(max(0, i))
        self.spec_box.blockSignals(False)
        self._on_sampling_changed(save=False)

    def _on_sampling_changed(self, *_args, save: bool = True) -> None:
        seed = self.seed.value()
        self.sampling = SamplingParams(max_tokens=self.max_tokens.value(),
                                       temperature=round(self.temperature.value(), 3),
                                       top_p=round(self.top_p.value(), 3),
                                       seed=None if seed < 0 else seed)
        if save and self.conversation.id:
            self.store.update_conversation(self.conversation.id, sampling=self._sampling_dict())

    # -- chatting ---------------------------------------------------------------------
    def send(self) -> None:
        text = self.prompt.text().strip()
        if self.answering or not text or not self.session.is_ready:
            return
        self.prompt.clear()
        cid = self.ensure_saved()
        if not self.conversation.turns:
            title = " ".join(text.split())[:TITLE_CHARS]
            self.conversation.title = title
            self.store.update_conversation(cid, title=title)
            self._set_title(title)
            self.title_changed.emit(cid, title)
        turn = self.conversation.add_user(text)
        turn.message_id = self.store.add_message(cid, len(self.conversation.turns) - 1, "user", text, DONE)
        self._answer_now()

    def _answer_now(self) -> None:
        """Start the assistant turn for the conversation as it stands."""
        engine = self.session.engine
        if engine is None:
            return
        cid = self.ensure_saved()
        answer = self.conversation.start_answer()
        answer.message_id = self.store.add_message(cid, len(self.conversation.turns) - 1, "assistant",
                                                   "", STREAMING)
        request = GenerateRequest(request_id=f"chat-{uuid.uuid4().hex[:12]}",
                                  messages=self.conversation.messages(), sampling=self.sampling,
                                  speculative=self.speculative_params())
        self.last_request, self.last_events = request, []
        self._answer, self._request_id, self._engine_used = answer, request.request_id, engine
        self._stop = threading.Event()
        self.banner.hide()
        self.chat_view.render_now()
        self._sync()
        self.answering_changed.emit(True)
        self.session.answer_started()
        task = self.runner.iterate(_stream_request, engine, request, self._stop, name="stream")
        task.item.connect(lambda ev: self._on_event(answer, ev))
        task.failed.connect(lambda exc: self._on_stream_failed(answer, exc))
        task.finished.connect(lambda: self._on_stream_finished(answer))

    def speculative_params(self) -> SpeculativeParams | None:
        """This conversation's speculation (None = the engine's default). Only the
        engines that speculate (local dense, pipeline) are asked to."""
        mode = self.spec_box.currentData()
        if mode == "default" or self.session.kind not in ("local", "pipeline"):
            return None
        return SpeculativeParams(mode=mode)

    def stop(self) -> None:
        """Cancel the running answer; the engine ends it with a 'cancelled' event."""
        if not self.answering or self._request_id is None or self._engine_used is None:
            return
        self._stop.set()
        self.stop_button.setEnabled(False)
        task = self.runner.call(self._engine_used.cancel, self._request_id, name="cancel")
        # Unknown id = the answer already ended or is not submitted yet (the
        # stream worker cancels right after submit): nothing to report.
        task.failed.connect(lambda exc: None)

    def regenerate(self) -> None:
        turns = self.conversation.turns
        if self.answering or not self.session.is_ready or not turns or turns[-1].role != "assistant":
            return
        turns.pop()
        self.store.truncate(self.ensure_saved(), len(turns))
        self._answer_now()

    def edit_last(self) -> None:
        """Put the last user message back in the prompt and drop it and its answer."""
        i = self.conversation.last_user_index()
        if self.answering or i is None:
            return
        text = self.conversation.turns[i].text
        del self.conversation.turns[i:]
        if self.conversation.id:
            self.store.truncate(self.conversation.id, i)
        self.chat_view.render_now()
        self.prompt.setPlainText(text)
        self.prompt.setFocus()
        self.prompt.moveCursor(self.prompt.textCursor().MoveOperation.End)
        self._sync()

    def _on_action(self, verb: str, index: int) -> None:
        if verb == "copy" and 0 <= index < len(self.conversation.turns):
            QApplication.clipboard().setText(self.conversation.turns[index].text)
        elif verb == "edit":
            self.edit_last()
        elif verb == "regenerate":
            self.regenerate()

    def _on_event(self, answer: Turn, event: TokenEvent) -> None:
        if answer.state != STREAMING:
            return  # already ended (an error seen first): later events change nothing
        if answer is self._answer:
            self.last_events.append(event)
        answer.text += event.text
        if event.final:
            self._finish(answer, event)
            self._save_and_paint(answer)
        elif not self._flush.isActive():
            self._flush.start()

    def _save_and_paint(self, answer: Turn | None = None) -> None:
        answer = answer or self._answer
        if answer is not None and answer.message_id is not None:
            self.store.save_message(answer.message_id, answer.text, answer.state, answer.note, answer.stats)
        self.chat_view.render_now()  # already coalesced by the flush timer

    def _finish(self, answer: Turn, event: TokenEvent) -> None:
        reason = event.finish_reason
        stats = {"engine": self.session.label(), "plan": self.session.plan_text}
        if event.usage is not None:
            stats["tokens"] = event.usage.completion_tokens
        if event.timings is not None:
            stats["ttft_s"] = round(event.timings.ttft_s, 3)
            stats["tok_s"] = round(event.timings.decode_tok_s, 1)
        answer.stats = stats
        if reason == "error":
            answer.state = ERROR
            answer.note = event.error or "the engine failed"
            self._engine_failed(answer.note, event.error_code == "peer_lost")
            return
        answer.state = CANCELLED if reason == "cancelled" else DONE
        parts = [f"{stats['tokens']} tokens"] if "tokens" in stats else []
        if "ttft_s" in stats:
            parts.append(f"{stats['ttft_s']:.2f} s to first token")
            if stats["tok_s"] > 0:
                parts.append(f"{stats['tok_s']:.1f} tok/s")
        parts.append(stats["engine"] + (f" ({stats['plan']})" if stats["plan"] else ""))
        if reason == "cancelled":
            parts.insert(0, "stopped")
        elif reason == "length":
            parts.insert(0, "cut at the token limit")
        answer.note = " · ".join(parts)

    def _engine_failed(self, reason: str, peer: bool) -> None:
        """A peer vanished (peer: the error's code says so, never its words) or the engine
        broke: say so plainly; keep everything."""
        head = "A peer stopped answering." if peer else "The engine could not answer."
        self.banner_label.setText(
            f"<b>{head}</b> {html.escape(reason)}<br>Your conversation is saved. "
            + ("Launch the plan again from the Plan view, or continue on the local engine."
               if peer else "Edit the message and send it again, or switch engines."))
        self.banner.show()
        if peer and self._engine_used is not None and self._engine_used is self.session.engine:
            self.session.mark_broken(reason)

    def _use_local(self) -> None:
        self.banner.hide()
        self.session.open(self.session.spec or "demo", "local")

    def _on_stream_failed(self, answer: Turn, exc: BaseException) -> None:
        if answer.state in (DONE, CANCELLED, ERROR):
            return
        answer.state = ERROR
        answer.note = str(exc) or type(exc).__name__
        self._engine_failed(answer.note, getattr(exc, "code", None) == "peer_lost")

    def _on_stream_finished(self, answer: Turn) -> None:
        self.session.answer_ended()
        if answer.state not in (DONE, CANCELLED, ERROR):
            # The stream ended without a final event (engine closed under us).
            answer.state = ERROR
            answer.note = answer.note or "the answer ended unexpectedly"
        self._save_and_paint(answer)
        if answer is self._answer:
            self._answer = self._request_id = self._engine_used = None
            self._sync()
            self.answering_changed.emit(False)
            if self.isVisible():
                self.prompt.setFocus()

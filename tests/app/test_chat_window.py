"""The chat window against the real local engine on the demo model.

One window (and so one engine open, the slow part) is shared by the module;
each test starts from a new chat. The window's answers are checked against
the same greedy request sent to the engine directly.
"""

from __future__ import annotations

import dataclasses

import pytest
from PySide6.QtCore import QCoreApplication, QDeadlineTimer, QEventLoop, Qt
from PySide6.QtWidgets import QApplication

from app.chat_view import display_text
from app.chat_window import ANSWERING, FAILED, READY, ChatWindow
from app.conversation import CANCELLED, DONE
from engine.protocol.messages import SamplingParams

OPEN_TIMEOUT_MS = 120_000  # a cold cache builds and compiles the demo model
ANSWER_TIMEOUT_MS = 30_000


def _wait(predicate, timeout_ms: int) -> None:
    """Spin the event loop until predicate() (for fixtures, which cannot use qtbot)."""
    deadline = QDeadlineTimer(timeout_ms)
    while not predicate():
        assert not deadline.hasExpired(), "timed out"
        QCoreApplication.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)


@pytest.fixture(scope="module")
def window(qapp: QApplication):
    win = ChatWindow("demo", "CPU")
    win.resize(1000, 700)
    win.show()
    _wait(lambda: win.state in (READY, FAILED), OPEN_TIMEOUT_MS)
    assert win.state == READY, win.status_label.text()
    yield win
    # Clean shutdown: the engine closes off the GUI thread, then the window goes.
    win.close()
    _wait(lambda: win.is_shut_down, 20_000)
    assert win.engine is None and not win.isVisible()


@pytest.fixture
def chat(window: ChatWindow, qtbot) -> ChatWindow:
    qtbot.waitUntil(lambda: window.state == READY, timeout=ANSWER_TIMEOUT_MS)
    window.new_chat()
    window.sampling = SamplingParams(max_tokens=64)
    window.prompt.clear()
    return window


def _type_and_enter(qtbot, win: ChatWindow, text: str) -> None:
    qtbot.keyClicks(win.prompt, text)
    qtbot.keyClick(win.prompt, Qt.Key.Key_Return)


def _wait_answer(qtbot, win: ChatWindow) -> None:
    qtbot.waitUntil(lambda: win.state == READY and win.conversation.answering is None,
                    timeout=ANSWER_TIMEOUT_MS)


def _reference(win: ChatWindow) -> str:
    """The same request, straight to the engine (blocking is fine in a test)."""
    req = dataclasses.replace(win.last_request, request_id=win.last_request.request_id + "-ref")
    return "".join(ev.text for ev in win.engine.generate(req))


def test_ready_status_and_models(chat: ChatWindow, qtbot) -> None:
    assert chat.status_label.text() == "demo · CPU · ready"
    assert chat.windowTitle() == "Flotilla" and not chat.windowIcon().isNull()
    qtbot.waitUntil(lambda: chat.model_box.count() > 1)  # demo ids listed in the background
    assert "demo" in [chat.model_box.itemText(i) for i in range(chat.model_box.count())]


def test_answer_streams_and_matches_engine(chat: ChatWindow, qtbot) -> None:
    _type_and_enter(qtbot, chat, "Hello there")
    assert chat.state == ANSWERING and not chat.send_button.isEnabled()
    _wait_answer(qtbot, chat)

    user, answer = chat.conversation.turns
    assert (user.role, user.text) == ("user", "Hello there")
    assert answer.state == DONE
    streamed = "".join(ev.text for ev in chat.last_events)
    assert answer.text == streamed and streamed
    assert len(chat.last_events) > 1  # token by token, not one lump
    assert streamed == _reference(chat)
    assert chat.chat_view.bubble_texts() == ["Hello there", display_text(streamed)]
    status = chat.status_label.text()
    assert status.startswith("demo · CPU · ready") and "first token" in status
    assert chat.prompt.isEnabled() and chat.prompt.text() == ""


def test_second_turn_sends_whole_conversation(chat: ChatWindow, qtbot) -> None:
    _type_and_enter(qtbot, chat, "Hello there")
    _wait_answer(qtbot, chat)
    first = chat.conversation.turns[1].text
    _type_and_enter(qtbot, chat, "Write a poem about the sea")
    _wait_answer(qtbot, chat)

    msgs = chat.last_request.messages
    assert [(m.role, m.content) for m in msgs] == [
        ("user", "Hello there"), ("assistant", first), ("user", "Write a poem about the sea")]
    second = chat.conversation.turns[3]
    assert second.state == DONE and second.text == _reference(chat)
    assert len(chat.chat_view.bubble_texts()) == 4


def test_shift_enter_inserts_newline(chat: ChatWindow, qtbot) -> None:
    qtbot.keyClicks(chat.prompt, "line one")
    qtbot.keyClick(chat.prompt, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(chat.prompt, "line two")
    assert chat.prompt.text() == "line one\nline two"
    assert chat.state == READY and chat.conversation.turns == []

    qtbot.keyClick(chat.prompt, Qt.Key.Key_Return)
    _wait_answer(qtbot, chat)
    assert chat.conversation.turns[0].text == "line one\nline two"
    assert chat.chat_view.bubble_texts()[0] == "line one\nline two"


def test_stop_mid_stream(chat: ChatWindow, qtbot) -> None:
    # This prompt runs to the token limit on the demo model (seconds of tokens).
    chat.sampling = SamplingParams(max_tokens=3000)
    _type_and_enter(qtbot, chat, "Describe the ocean in detail")
    answer = chat.conversation.turns[-1]
    qtbot.waitUntil(lambda: len(answer.text) > 20, timeout=ANSWER_TIMEOUT_MS)
    assert chat.stop_button.isEnabled()
    qtbot.mouseClick(chat.stop_button, Qt.MouseButton.LeftButton)
    _wait_answer(qtbot, chat)

    final = chat.last_events[-1]
    assert final.finish_reason == "cancelled" and answer.state == CANCELLED
    assert final.usage.completion_tokens < 3000
    assert answer.text == "".join(ev.text for ev in chat.last_events)
    assert chat.chat_view.bubble_texts()[-1] == display_text(answer.text)
    assert chat.prompt.isEnabled() and chat.send_button.isEnabled()
    assert not chat.stop_button.isEnabled()
    assert "stopped" in answer.note

    # The window is still usable, and the partial answer is part of the context.
    chat.sampling = SamplingParams(max_tokens=16)
    _type_and_enter(qtbot, chat, "Go on")
    _wait_answer(qtbot, chat)
    assert chat.conversation.turns[-1].state == DONE
    assert chat.last_request.messages[1].content == answer.text


def test_stop_before_first_token(chat: ChatWindow, qtbot) -> None:
    # Stop in the same GUI tick as send: the worker may not have submitted yet.
    chat.sampling = SamplingParams(max_tokens=3000)
    chat.prompt.setPlainText("Describe the ocean in detail")
    chat.send()
    chat.stop()
    _wait_answer(qtbot, chat)
    assert chat.last_events[-1].finish_reason == "cancelled"
    assert chat.prompt.isEnabled()


def test_open_failure_is_reported_not_raised(qapp: QApplication, qtbot) -> None:
    win = ChatWindow("/nonexistent/flotilla-model", "CPU")
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.state == FAILED, timeout=ANSWER_TIMEOUT_MS)
    assert "Could not open" in win.status_label.text()
    assert win._error_box is not None and win._error_box.isVisible()
    assert not win.send_button.isEnabled()
    win._error_box.close()
    win.close()
    qtbot.waitUntil(lambda: win.is_shut_down, timeout=10_000)

"""The whole app against real engines on the demo model.

One main window (and so one engine open, the slow part) is shared by the
module; the tests run in file order, which is the order a user would go:
views and keyboard, chat (stream, stall, stop, regenerate, edit, detach),
fleet, models, settings, the plan editor (auto-plan, drag, infeasible),
a 2-stage local pipeline launched from the editor, a stage killed mid-chat,
and finally a restart that finds the conversations again.
"""

from __future__ import annotations

import functools

import json
import os
import shutil
import signal
import sys
import socket
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from PySide6.QtCore import QCoreApplication, QDeadlineTimer, QElapsedTimer, QEventLoop, QPoint, Qt, QTimer
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QLabel

from app.chat.conversation import CANCELLED, DONE, ERROR
from app.main import create_window
from app.main_window import MainWindow
from app.chat.store import ChatStore
from engine import client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "fleet"))
from fleet_helpers import AgentProc  # noqa: E402

OPEN_TIMEOUT_MS = 180_000  # a cold cache builds and compiles the demo model
ANSWER_TIMEOUT_MS = 60_000
STALL_LIMIT_MS = 50


def _wait(predicate, timeout_ms: int) -> None:
    """Spin the event loop until predicate() (for fixtures, which cannot use qtbot)."""
    deadline = QDeadlineTimer(timeout_ms)
    while not predicate():
        assert not deadline.hasExpired(), "timed out"
        QCoreApplication.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)


@pytest.fixture(scope="module")
def win(qapp: QApplication):
    w = create_window("demo")
    w.resize(1280, 800)
    w.show()
    _wait(lambda: w.session.state in ("ready", "failed"), OPEN_TIMEOUT_MS)
    assert w.session.is_ready, w.session.error
    yield w
    if not w.is_shut_down:
        w.close()
        _wait(lambda: w.is_shut_down, 30_000)


@pytest.fixture
def panel(win: MainWindow, qtbot):
    win.show_view("chat")
    qtbot.waitUntil(lambda: win.session.is_ready, timeout=OPEN_TIMEOUT_MS)
    p = win.chat.panel
    qtbot.waitUntil(lambda: not p.answering, timeout=ANSWER_TIMEOUT_MS)
    win.chat.new_chat()
    p.max_tokens.setValue(48)
    return p


def _type_and_enter(qtbot, panel, text: str) -> None:
    panel.prompt.setFocus()
    qtbot.keyClicks(panel.prompt, text)
    qtbot.keyClick(panel.prompt, Qt.Key.Key_Return)


def _wait_answer(qtbot, panel, timeout=ANSWER_TIMEOUT_MS) -> None:
    qtbot.waitUntil(lambda: not panel.answering, timeout=timeout)


def _saved(win: MainWindow, cid: str) -> list[tuple[str, str, str]]:
    return [(m.role, m.text, m.state) for m in win.store.messages(cid)]


# -- shell: views, shortcuts, keyboard ------------------------------------------------------------
def test_first_start_is_ready_on_demo(win: MainWindow) -> None:
    assert win.current_view() == "chat"
    assert win.session.info.model_id == "demo" and win.session.kind == "local"
    assert "demo · local · CPU" in win.status_label.text()
    assert win.windowTitle() == "Flotilla" and not win.windowIcon().isNull()
    assert all(not b.icon().isNull() for b in win.nav.values())


def test_ctrl_number_switches_views(win: MainWindow, qtbot) -> None:
    for i, key in enumerate(["fleet", "models", "plan", "chat", "settings"]):
        QTest.keyClick(win, Qt.Key(Qt.Key.Key_1 + i), Qt.KeyboardModifier.ControlModifier)
        assert win.current_view() == key
        assert win.nav[key].isChecked()
    QTest.keyClick(win, Qt.Key.Key_4, Qt.KeyboardModifier.ControlModifier)
    assert win.chat.panel.prompt.hasFocus()  # Chat lands the keyboard in the prompt


@pytest.mark.parametrize("view, targets", [
    ("fleet", ["address", "add_button"]),
    ("models", ["table", "chat_button", "hub_id"]),
    ("plan", ["model_box", "engine_box", "where_box", "stages_spin", "bar", "settings.context",
              "settings.spec_mode", "auto_button"]),
    ("chat", ["prompt", "send_button"]),
    ("settings", ["api_switch", "api_port", "save_policy_button"]),
])
def test_tab_reaches_every_control(win: MainWindow, qtbot, view: str, targets: list[str]) -> None:
    win.show_view(view, focus=True)
    page = win.pages[view]
    owner = page if view != "chat" else page.panel
    wanted = {id(functools.reduce(getattr, t.split("."), owner)): t for t in targets}
    seen: set[str] = set()
    for _ in range(60):
        QTest.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        w = QApplication.focusWidget()
        if w is not None and id(w) in wanted:
            seen.add(wanted[id(w)])
            assert w.focusPolicy() != Qt.FocusPolicy.NoFocus
    assert seen == set(targets)


# -- chat ---------------------------------------------------------------------------------------------
def _long_answers(panel, tokens: int) -> None:
    """Answers of exactly `tokens` tokens unless stopped: random weights may say EOS at
    once on some CPUs (f32 vs bf16 kernels), so a test that needs a long answer turns
    EOS off instead of hoping the model keeps talking."""
    panel.max_tokens.setValue(tokens)
    panel.sampling = msgspec.structs.replace(panel.sampling, ignore_eos=True)


def test_answer_streams_is_saved_and_never_stalls_the_gui(win: MainWindow, panel, qtbot) -> None:
    _long_answers(panel, 600)  # seconds of tokens at full speed
    gaps = []
    clock = QElapsedTimer()
    clock.start()
    last = [clock.elapsed()]

    slow: list[tuple[int, list[str]]] = []  # what ran in the background during a long gap

    def beat() -> None:
        now = clock.elapsed()
        gaps.append(now - last[0])
        if now - last[0] > 30:
            slow.append((now - last[0], sorted(t.name for t in win.runner._tasks)))
        last[0] = now

    heartbeat = QTimer(interval=5)
    heartbeat.timeout.connect(beat)
    heartbeat.start()
    _type_and_enter(qtbot, panel, "Describe the ocean in detail")
    assert panel.answering and not panel.send_button.isEnabled()
    last[0] = clock.elapsed()
    gaps.clear()
    _wait_answer(qtbot, panel)
    heartbeat.stop()

    user, answer = panel.conversation.turns
    assert answer.state == DONE and len(panel.last_events) > 100
    assert answer.text == "".join(ev.text for ev in panel.last_events)
    worst = max(gaps)
    print(f"\nlargest GUI stall while streaming {len(panel.last_events)} events: {worst} ms")
    assert worst < STALL_LIMIT_MS, f"GUI thread stalled {worst} ms; long gaps: {slow}"
    # Saved as streamed, with its stats.
    cid = panel.conversation.id
    assert _saved(win, cid) == [("user", "Describe the ocean in detail", "done"),
                                ("assistant", answer.text, "done")]
    stats = win.store.messages(cid)[1].stats
    assert stats["engine"] == "demo · local · CPU" and stats["tokens"] > 100 and stats["tok_s"] > 0
    assert "tok/s" in answer.note and "s to first token" in answer.note
    assert win.chat.titles()[0].startswith("Describe the ocean")


def test_shift_enter_newline_and_system_prompt(panel, qtbot) -> None:
    panel.system_button.click()
    panel.system_edit.setPlainText("You are terse.")
    panel.prompt.setFocus()
    qtbot.keyClicks(panel.prompt, "line one")
    qtbot.keyClick(panel.prompt, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(panel.prompt, "line two")
    assert panel.prompt.text() == "line one\nline two" and not panel.answering
    qtbot.keyClick(panel.prompt, Qt.Key.Key_Return)
    _wait_answer(qtbot, panel)
    msgs = panel.last_request.messages
    assert [(m.role, m.content) for m in msgs] == [("system", "You are terse."), ("user", "line one\nline two")]
    assert panel.chat_view.bubble_texts()[0] == "line one\nline two"
    panel.system_button.click()


def test_stop_mid_stream(win: MainWindow, panel, qtbot) -> None:
    _long_answers(panel, 3000)
    _type_and_enter(qtbot, panel, "Describe the ocean in detail")
    answer = panel.conversation.turns[-1]
    qtbot.waitUntil(lambda: len(answer.text) > 20, timeout=ANSWER_TIMEOUT_MS)
    assert panel.stop_button.isEnabled()
    qtbot.mouseClick(panel.stop_button, Qt.MouseButton.LeftButton)
    _wait_answer(qtbot, panel)
    final = panel.last_events[-1]
    assert final.finish_reason == "cancelled" and answer.state == CANCELLED
    assert final.usage.completion_tokens < 3000 and "stopped" in answer.note
    assert _saved(win, panel.conversation.id)[-1] == ("assistant", answer.text, "cancelled")
    assert panel.send_button.isEnabled() and not panel.stop_button.isEnabled()


def test_regenerate_replaces_the_answer(win: MainWindow, panel, qtbot) -> None:
    panel.temperature.setValue(0.9)  # sampled, so a new answer differs
    # long enough to go past any answer the trained demo knows by heart (it says who it is word for word)
    _long_answers(panel, 120)
    _type_and_enter(qtbot, panel, "Tell me a story")
    _wait_answer(qtbot, panel)
    first = panel.conversation.turns[-1].text
    request = panel.last_request
    QTest.keyClick(panel.prompt, Qt.Key.Key_R, Qt.KeyboardModifier.ControlModifier)  # Ctrl+R
    assert panel.answering
    _wait_answer(qtbot, panel)
    turns = panel.conversation.turns
    assert len(turns) == 2 and turns[-1].state == DONE and turns[-1].text != first
    assert panel.last_request.messages == request.messages  # the same question again
    assert [r for r, _t, _s in _saved(win, panel.conversation.id)] == ["user", "assistant"]
    panel.temperature.setValue(0.0)


def test_edit_and_resend(win: MainWindow, panel, qtbot) -> None:
    _type_and_enter(qtbot, panel, "Helo wrld")
    _wait_answer(qtbot, panel)
    panel.chat_view.action.emit("edit", 0)  # the "Edit" link under the user bubble
    assert panel.conversation.turns == [] and panel.prompt.text() == "Helo wrld"
    panel.prompt.clear()
    _type_and_enter(qtbot, panel, "Hello world")
    _wait_answer(qtbot, panel)
    assert [t.text for t in panel.conversation.turns][0] == "Hello world"
    assert _saved(win, panel.conversation.id)[0] == ("user", "Hello world", "done")
    panel.chat_view.action.emit("copy", 1)
    assert QApplication.clipboard().text() == panel.conversation.turns[1].text


def test_detached_windows_stream_interleaved(win: MainWindow, panel, qtbot) -> None:
    _type_and_enter(qtbot, panel, "First conversation")
    _wait_answer(qtbot, panel)
    cid = panel.conversation.id
    panel.detach_button.click()
    detached = win.chat.windows[cid]
    assert detached.isVisible() and detached.panel.conversation.id == cid
    assert panel.conversation.id is None  # the main panel moved on to a new chat
    assert any("(own window)" in t for t in win.chat.titles())
    for p in (detached.panel, panel):
        p.max_tokens.setValue(300)
        p.prompt.setPlainText("Keep talking about boats")
    detached.panel.send()
    panel.send()
    assert detached.panel.answering and panel.answering  # both in flight on one engine
    qtbot.waitUntil(lambda: not detached.panel.answering and not panel.answering, timeout=ANSWER_TIMEOUT_MS)
    assert detached.panel.conversation.turns[-1].state == DONE
    assert panel.conversation.turns[-1].state == DONE
    assert len(_saved(win, cid)) == 4
    detached.close()
    qtbot.waitUntil(lambda: cid not in win.chat.windows, timeout=5000)


def test_chat_status_shows_queued_requests(win: MainWindow, panel, qtbot) -> None:
    engine = win.session.engine
    saved = engine.max_concurrent
    engine.max_concurrent = 1  # one answer at a time: the second one waits in the engine's queue
    try:
        _type_and_enter(qtbot, panel, "First conversation")
        _wait_answer(qtbot, panel)
        cid = panel.conversation.id
        panel.detach_button.click()
        other = win.chat.windows[cid].panel
        for p in (other, panel):
            # Long answers (seconds even at full speed), so the second one is
            # still waiting when the status is refreshed; both are stopped below.
            _long_answers(p, 3000)
            p.prompt.setPlainText("Keep talking about boats")
        other.send()
        panel.send()
        qtbot.waitUntil(lambda: "1 queued" in panel.engine_label.text(), timeout=10_000)
        assert "1 queued" in other.engine_label.text()
        panel.stop()
        other.stop()
        qtbot.waitUntil(lambda: not other.answering and not panel.answering, timeout=ANSWER_TIMEOUT_MS)
        assert "queued" not in panel.engine_label.text()
        win.chat.windows[cid].close()
        qtbot.waitUntil(lambda: cid not in win.chat.windows, timeout=5000)
    finally:
        engine.max_concurrent = saved


def test_engine_error_shows_banner_and_keeps_conversation(win: MainWindow, panel, qtbot) -> None:
    _type_and_enter(qtbot, panel, "Hello")
    _wait_answer(qtbot, panel)
    # A real engine error event: a prompt longer than the model's context.
    panel.prompt.setPlainText("sail " * 6000)
    panel.send()
    answer = panel.conversation.turns[-1]
    _wait_answer(qtbot, panel)
    assert answer.state == ERROR and panel.banner.isVisible()
    assert answer.note and answer.note[:40] in panel.banner_label.text().replace("&quot;", '"')
    assert win.session.is_ready  # a bad request does not break the engine
    assert [t.role for t in panel.conversation.turns] == ["user", "assistant", "user", "assistant"]
    assert _saved(win, panel.conversation.id)[-1][2] == "error"
    # The failed turn is left out of the next request; the conversation goes on.
    panel.banner.hide()
    _type_and_enter(qtbot, panel, "Shorter, then")
    _wait_answer(qtbot, panel)
    assert panel.conversation.turns[-1].state == DONE
    assert [m.content for m in panel.last_request.messages if m.role == "user"] == ["Hello", "Shorter, then"]


# -- fleet, models, settings ----------------------------------------------------------------------
def test_fleet_shows_this_pc_and_a_peer_added_by_address(win: MainWindow, qtbot) -> None:
    win.show_view("fleet")
    fleet = win.fleet
    qtbot.waitUntil(lambda: fleet.this_pc is not None and bool(fleet.cards), timeout=20_000)
    this = fleet.cards[0].card
    assert this.local and this.devices and this.ram_total > this.ram_free > 0
    qtbot.waitUntil(lambda: "mDNS on 127.0.0.1" in fleet.notice.text(), timeout=20_000)
    assert "not available yet" not in fleet.notice.text()
    assert "No pipeline is running" in fleet.ring.describe()
    fleet.address.setText("192.0.2.1")  # TEST-NET: never answers
    fleet.add_button.click()
    qtbot.waitUntil(lambda: fleet.card_widget("192.0.2.1:47600") is not None, timeout=20_000)
    peer = fleet.card_widget("192.0.2.1:47600")
    assert not peer.usable and not peer.findChild(QLabel).isEnabled() and "cannot be contacted" in peer.card.reason
    assert client.peer_addresses() == ["192.0.2.1:47600"]
    peer.remove_button.click()
    qtbot.waitUntil(lambda: fleet.card_widget("192.0.2.1:47600") is None, timeout=20_000)
    qtbot.waitUntil(lambda: client.peer_addresses() == [], timeout=10_000)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """A real agent on loopback, announced over mDNS on 127.0.0.1 only, with the real shard worker."""
    a = AgentProc(tmp_path_factory.mktemp("app-agent"), mdns=True, real_worker=True).start()
    a.node_id = json.loads((a.config / "identity.json").read_text())["node_id"]
    yield a
    a.stop()


def test_the_banner_takes_its_category_from_the_error_code(panel) -> None:
    """A lost peer reads as one whatever its words, and an engine error whose words mention a
    stage is still the engine's: the panel branches on TokenEvent.error_code, not on words."""
    from app.chat.conversation import STREAMING, Turn
    from engine.protocol.messages import TokenEvent, Usage

    used, panel._engine_used = panel._engine_used, None  # not the session's engine: nothing is marked broken
    try:
        for words, code, head in (("the other computer reset the connection", "peer_lost",
                                   "A peer stopped answering"),
                                  ("stage directions in the pipeline of a peer", "engine",
                                   "The engine could not answer")):
            turn = Turn("assistant", "", STREAMING)
            panel._finish(turn, TokenEvent("r-banner", finish_reason="error", error=words, error_code=code,
                                           usage=Usage(1, 0)))
            assert turn.state == ERROR and head in panel.banner_label.text()
            panel.banner.hide()
    finally:
        panel._engine_used = used


def test_fleet_discovers_an_agent_and_pairs_with_the_code(win: MainWindow, agent, qtbot) -> None:
    from engine.transport.security import pairing_code

    win.show_view("fleet")
    fleet = win.fleet
    qtbot.waitUntil(lambda: fleet.card_widget(agent.node_id) is not None, timeout=20_000)
    card = fleet.card_widget(agent.node_id)
    assert card.card.source == "mdns" and card.card.paired is False and "not paired" in card.pair_label.text()
    assert card.pair_button is not None and card.pair_button.isEnabled()
    card.pair_button.click()
    dlg = fleet.dialog
    qtbot.waitUntil(lambda: bool(dlg.code), timeout=20_000)
    code = pairing_code(agent.public_key, _app_key(win))
    assert dlg.code == code and dlg.code_label.text() == f"{code[:3]} {code[3:]}"
    assert f"flotilla agent pair --accept {code}" in dlg.help.text()
    # The owner compares the codes and accepts on the agent's PC (its tray, or the CLI).
    qtbot.waitUntil(lambda: code in [r.code for r in client.AgentHandle(agent.config).state().pending],
                    timeout=20_000)
    assert client.AgentHandle(agent.config).accept(code).startswith("Flotilla app on")
    qtbot.waitUntil(lambda: dlg.state == "accepted", timeout=20_000)
    assert "Paired" in dlg.status.text()
    dlg.accept()
    qtbot.waitUntil(lambda: fleet.card_widget(agent.node_id) is not None
                    and fleet.card_widget(agent.node_id).card.paired, timeout=20_000)
    assert "paired" in fleet.card_widget(agent.node_id).pair_label.text()
    assert fleet.card_widget(agent.node_id).revoke_button is not None


def _app_key(win: MainWindow) -> str:
    return (Path(os.environ["FLOTILLA_CONFIG"]) / "node_key.public").read_text().strip()


def test_models_lists_profiles_and_explains_offline_download(win: MainWindow, qtbot, tmp_path) -> None:
    win.show_view("models")
    m = win.models
    qtbot.waitUntil(lambda: any(e.model_id == "demo" for e in m.entries), timeout=20_000)
    row = [e.model_id for e in m.entries].index("demo")
    qtbot.waitUntil(lambda: m.table.item(row, 4).text() == "8", timeout=20_000)
    moe = [e.model_id for e in m.entries].index("demo-moe")
    qtbot.waitUntil(lambda: m.table.item(moe, 5).text() == "8 (top-2)", timeout=20_000)
    m.hub_id.setText("someone/some-model")
    m.download_button.click()
    qtbot.waitUntil(lambda: m.download_button.isEnabled(), timeout=30_000)
    assert "Download failed" in m.job_label.text() and "offline" in m.job_label.text()
    m.import_folder(str(tmp_path))
    qtbot.waitUntil(lambda: "Cannot import" in m.job_label.text(), timeout=10_000)


def test_settings_api_server_and_sharing_policy(win: MainWindow, qtbot) -> None:
    win.show_view("settings")
    s = win.settings_view
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s.api_port.setValue(port)
    s.api_port.editingFinished.emit()
    s.api_switch.setChecked(True)
    qtbot.waitUntil(lambda: "serving" in s.api_status.text(), timeout=20_000)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        data = json.loads(r.read())
    assert data["data"][0]["id"] == "demo"
    s.api_switch.setChecked(False)
    qtbot.waitUntil(lambda: s.api_status.text() == "off", timeout=20_000)
    with socket.socket() as taken:  # a port in use: a clear reason, no retry loop, no crash
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s.api_port.setValue(taken.getsockname()[1])
        s.api_port.editingFinished.emit()
        s.api_switch.setChecked(True)
        qtbot.waitUntil(lambda: "cannot start" in s.api_status.text(), timeout=20_000)
        s.api_switch.setChecked(False)
    qtbot.waitUntil(lambda: s.api_status.text() == "off", timeout=20_000)

    s.max_ram.setValue(3.5)
    s.device_checks["NPU"].setChecked(False)
    s.save_policy()
    qtbot.waitUntil(lambda: "Saved to" in s.policy_status.text(), timeout=10_000)
    saved = json.loads(client.sharing_policy_path().read_text())
    assert saved["max_ram_gb"] == 3.5 and saved["devices"] == ["CPU", "GPU"]


# -- plan editor ------------------------------------------------------------------------------------
@pytest.fixture
def plan(win: MainWindow, qtbot):
    win.show_view("plan")
    p = win.plan
    qtbot.waitUntil(lambda: bool(p.kinds) and p.plan is not None, timeout=60_000)
    return p


def test_auto_plan_and_drag_a_boundary(plan, qtbot) -> None:
    plan.stages_spin.setValue(2)
    plan.auto_button.click()
    qtbot.waitUntil(lambda: plan.plan is not None and len(plan.plan.stages) == 2, timeout=20_000)
    assert [(s.start, s.end) for s in plan.plan.stages] == [(0, 4), (4, 8)]
    assert plan.launch_button.isEnabled() and not plan.error
    bar = plan.bar
    start = bar.boundary_point(0).toPoint()
    end = QPoint(int(bar.layer_x(6)), start.y())
    QTest.mousePress(bar, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, start)
    for x in range(start.x(), end.x() + 1, 8):
        QTest.mouseMove(bar, QPoint(x, start.y()))
    QTest.mouseMove(bar, end)
    QTest.mouseRelease(bar, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, end)
    assert [(s.start, s.end) for s in plan.plan.stages] == [(0, 6), (6, 8)]
    assert bar.segments[0].end == 6 and "0–6" in bar.accessibleDescription()
    # The prediction follows: stage 0 now has more layers, so it is slower.
    assert plan.plan.stages[0].predicted_tok_s < plan.plan.stages[1].predicted_tok_s
    # Keyboard: Left moves the selected boundary back one layer.
    bar.setFocus()
    QTest.keyClick(bar, Qt.Key.Key_Left)
    assert plan.plan.stages[0].end == 5


def test_infeasible_plan_cannot_launch(plan, qtbot) -> None:
    plan.settings.context.setValue(1_048_576)
    plan.settings.streams.setValue(64)
    qtbot.waitUntil(lambda: bool(plan.error), timeout=5000)
    assert not plan.launch_button.isEnabled()
    assert "needs" in plan.error and "GB" in plan.error
    assert "cannot launch" in plan.summary.text() and plan.bar.invalid
    assert not any(s.fits for s in plan.bar.segments)
    assert "invalid" in plan.launch_button.toolTip()
    plan.launch()  # even a direct call refuses
    assert plan.session.kind == "local"
    plan.settings.context.setValue(4096)
    plan.settings.streams.setValue(4)
    qtbot.waitUntil(lambda: not plan.error, timeout=5000)
    assert plan.launch_button.isEnabled()


def test_disabled_choices_say_why(plan) -> None:
    # Speculative decoding: available for the pipeline on this PC and the local engine;
    # disabled with the reason where it does not apply.
    assert plan.settings.spec_mode.isEnabled() and not plan.settings.spec_reason.text().startswith("Not available")
    plan.settings.spec_mode.setCurrentIndex(plan.settings.spec_mode.findData("draft"))
    assert plan.settings.draft_box.isEnabled() and plan.settings.draft_box.currentText() == "demo-draft"
    assert plan.settings.speculative_choice() == client.SpecChoice("draft", 4, True, "demo-draft")
    plan.settings.spec_mode.setCurrentIndex(plan.settings.spec_mode.findData("lookup"))
    assert not plan.settings.draft_box.isEnabled() and plan.settings.spec_k.isEnabled()
    idx = plan.engine_box.findData("moe")
    plan.engine_box.setCurrentIndex(idx)
    assert not plan.launch_button.isEnabled() and "dense" in plan.launch_blocker()
    assert not plan.settings.spec_mode.isEnabled() and "no speculative decoding" in plan.settings.spec_reason.text()
    plan.engine_box.setCurrentIndex(plan.engine_box.findData("pipeline"))
    plan.settings.spec_mode.setCurrentIndex(plan.settings.spec_mode.findData("off"))
    assert plan.settings.speculative_choice() is None


def test_fleet_plan_launches_on_the_paired_agent_and_chats(win: MainWindow, plan, agent, qtbot) -> None:
    plan.where_box.setCurrentIndex(plan.where_box.findData("fleet"))
    qtbot.waitUntil(lambda: plan.plan is not None and not plan.error
                    and [s.peer_id for s in plan.plan.stages] == [agent.node_id], timeout=20_000)
    assert not plan.stages_spin.isVisible()
    plan.pin(agent.node_id, "CPU")  # its GPU is a test double (FLOTILLA_FLEET_DEVICES)
    assert plan.launch_blocker() == "", plan.launch_blocker()
    plan.launch_button.click()
    qtbot.waitUntil(lambda: win.session.state in ("ready", "failed"), timeout=OPEN_TIMEOUT_MS)
    assert win.session.is_ready, win.session.error
    assert plan.progress.phases() == ["ready"] and win.session.kind == "pipeline"
    assert "1 peers:" in win.session.plan_text and agent.node_id[:4] not in win.session.plan_text
    win.show_view("chat")
    panel = win.chat.panel
    win.chat.new_chat()
    panel.max_tokens.setValue(12)
    _type_and_enter(qtbot, panel, "Hello fleet")
    _wait_answer(qtbot, panel)
    assert panel.conversation.turns[-1].state == DONE, panel.conversation.turns[-1].note
    win.show_view("plan")
    plan.where_box.setCurrentIndex(plan.where_box.findData("local"))
    win.session.open("demo", "local")  # back to this PC (the agent's worker is unloaded)
    qtbot.waitUntil(lambda: win.session.is_ready, timeout=OPEN_TIMEOUT_MS)
    qtbot.waitUntil(lambda: plan.plan is not None and len(plan.plan.stages) == 2 and not plan.error,
                    timeout=20_000)


def test_launch_cancel_stops_everything(win: MainWindow, plan, qtbot) -> None:
    plan.settings.recover.setChecked(False)  # no warm standby: a killed stage must end the answers (below)
    plan.auto_button.click()
    qtbot.waitUntil(lambda: plan.plan is not None and not plan.error, timeout=20_000)
    plan.launch_button.click()
    assert win.session.state == "opening" and plan.cancel_button.isEnabled()
    qtbot.waitUntil(lambda: any(t.startswith("compile") for t in plan.progress.phases()), timeout=60_000)
    plan.cancel_button.click()
    qtbot.waitUntil(lambda: win.session.state == "failed", timeout=30_000)
    assert win.session.error == "launch cancelled"
    assert set(plan.progress.phases()) == {"stopped"} and "cancelled" in plan.launch_reason.text()


def test_launch_two_stage_pipeline_chat_then_kill_a_stage(win: MainWindow, plan, qtbot) -> None:
    plan.launch_button.click()
    qtbot.waitUntil(lambda: win.session.state in ("ready", "failed"), timeout=OPEN_TIMEOUT_MS)
    assert win.session.is_ready, win.session.error
    assert win.session.kind == "pipeline" and plan.progress.phases() == ["ready", "ready"]
    pids = client.stage_pids(win.session.engine)
    assert len(pids) == 2
    logs = win.session.engine.fleet.log_dir  # a temporary folder, kept once a stage died (its error names it)

    win.show_view("chat")
    panel = win.chat.panel
    win.chat.new_chat()
    panel.max_tokens.setValue(40)
    _type_and_enter(qtbot, panel, "Hello pipeline")
    _wait_answer(qtbot, panel)
    answer = panel.conversation.turns[-1]
    assert answer.state == DONE and "pipeline" in answer.note and "2 stages" in answer.note
    win.show_view("fleet")
    qtbot.waitUntil(lambda: "stage 1 layers" in win.fleet.ring.describe(), timeout=10_000)

    # A peer vanishes mid-answer: kill stage 1's process.
    win.show_view("chat")
    _long_answers(panel, 3000)
    _type_and_enter(qtbot, panel, "Describe the ocean in detail")
    long = panel.conversation.turns[-1]
    qtbot.waitUntil(lambda: len(long.text) > 20, timeout=ANSWER_TIMEOUT_MS)
    os.kill(pids[1], signal.SIGKILL)
    _wait_answer(qtbot, panel)
    assert long.state == ERROR and "stage 1" in long.note
    assert panel.banner.isVisible() and "stopped answering" in panel.banner_label.text()
    assert win.session.state == "failed"
    cid = panel.conversation.id
    saved = _saved(win, cid)
    assert [r for r, _t, _s in saved] == ["user", "assistant", "user", "assistant"]
    assert saved[-1] == ("assistant", long.text, "error")  # the partial answer is kept
    assert not panel.send_button.isEnabled() and "no engine" in panel.send_button.toolTip()
    assert (logs / "stage-1.log").is_file()
    shutil.rmtree(logs)  # the user's to read; the test's to clean up

    panel.banner_local.click()  # back to the local engine, same conversation
    qtbot.waitUntil(lambda: win.session.is_ready, timeout=OPEN_TIMEOUT_MS)
    panel.max_tokens.setValue(16)
    _type_and_enter(qtbot, panel, "Still there?")
    _wait_answer(qtbot, panel)
    assert panel.conversation.turns[-1].state == DONE
    time.sleep(0.1)
    assert all(_gone(pid) for pid in pids)  # no orphaned stage process


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


# -- restart -------------------------------------------------------------------------------------------
def test_restart_finds_the_conversations(win: MainWindow, qapp, qtbot) -> None:
    titles = [t.removesuffix("  (own window)") for t in win.chat.titles()]
    current = win.chat.panel.conversation
    texts = [t.text for t in current.turns]
    win.close()
    qtbot.waitUntil(lambda: win.is_shut_down, timeout=30_000)
    again = create_window(open_engine=False)
    qtbot.addWidget(again)
    try:
        assert again.chat.titles() == titles
        assert again.chat.panel.conversation.id == current.id  # the most recent is reopened
        assert [t.text for t in again.chat.panel.conversation.turns] == texts
        assert isinstance(again.store, ChatStore) and again.store.journal_mode == "wal"
    finally:
        again.close()
        qtbot.waitUntil(lambda: again.is_shut_down, timeout=10_000)

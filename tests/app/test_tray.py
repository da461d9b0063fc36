"""The agent's tray against a real headless agent process on loopback.

The agent runs as `python -m engine.cli.agent_cmd --headless` (the fleet
tests' AgentProc: 127.0.0.1 only, no mDNS, the idle time read from a file, a
tiny echo shard worker); the tray reads and drives it through
engine.client.AgentHandle, as `flotilla agent` does with a display. In order:
sharing when the owner is away, idle when they are back, Share now, Pause, a
pairing request with its code (notification, Accept), busy while a paired
controller runs a shard worker, Revoke, and the Policy… dialog.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "fleet"))
from fleet_helpers import AgentProc, free_port, set_idle  # noqa: E402

from app.background import Runner  # noqa: E402
from app.tray import Tray  # noqa: E402
from engine import client  # noqa: E402

STATE_MS = 15_000  # the agent polls the machine every 0.5 s; the tray the agent every 0.2 s


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = AgentProc(tmp_path_factory.mktemp("tray")).start()
    yield a
    a.stop()


@pytest.fixture(scope="module")
def tray(agent, qapp):
    runner = Runner(max_threads=4)
    handle = client.AgentHandle(agent.config, info_port=agent.base + 2, pid=agent.proc.pid)
    t = Tray(runner, handle, poll_ms=200)
    t.notes = []
    t.notified.connect(lambda title, msg: t.notes.append((title, msg)))
    yield t
    t._timer.stop()
    runner.wait_for_done(5000)


def _wait_state(qtbot, tray, state: str) -> None:
    qtbot.waitUntil(lambda: tray.state is not None and tray.state.state == state, timeout=STATE_MS)
    assert tray.icon_state == state
    assert state.split()[0] in tray.icon.toolTip().lower() or tray.state.summary in tray.icon.toolTip()


def test_sharing_then_idle_when_the_owner_returns(agent, tray, qtbot) -> None:
    _wait_state(qtbot, tray, "sharing")
    assert tray.state.running and tray.state.workers == 0
    assert "you are away" in tray.header.text()
    assert tray.share_action.isEnabled() and not tray.share_action.isChecked()
    set_idle(agent.idle_file, 0)  # the owner is back
    _wait_state(qtbot, tray, "idle")
    assert "you are using this PC" in tray.state.summary


def test_share_now_and_pause(agent, tray, qtbot) -> None:
    tray.share_action.trigger()  # lend it now, although the owner is here
    _wait_state(qtbot, tray, "sharing")
    assert tray.share_action.isChecked() and "Share now" in tray.state.summary
    assert tray.handle.load_policy()["idle_minutes"] == 0
    tray.share_action.trigger()  # back to the policy's idle wait
    _wait_state(qtbot, tray, "idle")
    assert tray.handle.load_policy()["idle_minutes"] == 5
    tray.pause_action.trigger()
    _wait_state(qtbot, tray, "paused")
    assert tray.pause_action.isChecked() and not tray.handle.load_policy()["enabled"]
    tray.pause_action.trigger()
    _wait_state(qtbot, tray, "idle")


def test_pairing_request_shows_the_code_and_accept_pairs(agent, tray, qtbot) -> None:
    from engine.fleet.client import async_pair
    from engine.transport.security import KeyPair, pairing_code

    keys = KeyPair.generate()
    code = pairing_code(agent.public_key, keys.public)
    first = asyncio.run(async_pair(keys, agent.pairing, agent.public_key, "laptop-of-ana"))
    assert first.state == "pending"
    qtbot.waitUntil(lambda: code in tray.request_actions, timeout=STATE_MS)
    accept, deny = tray.request_actions[code]
    assert f"{code[:3]} {code[3:]}" in accept.text() and deny.text() == "Deny"
    assert "1 pairing request" in tray.state.summary and "Pairing requests (1)" in tray.requests_header.text()
    assert any(t == "Pairing request" and "laptop-of-ana" in m and code[:3] in m for t, m in tray.notes)
    accept.trigger()
    qtbot.waitUntil(lambda: not tray.request_actions and len(tray.revoke_actions) == 1, timeout=STATE_MS)
    assert asyncio.run(async_pair(keys, agent.pairing, agent.public_key, "laptop-of-ana")).state == "accepted"
    tray.paired_keys = keys


def test_deny_hides_a_request(agent, tray, qtbot) -> None:
    from engine.fleet.client import async_pair
    from engine.transport.security import KeyPair, pairing_code

    keys = KeyPair.generate()
    code = pairing_code(agent.public_key, keys.public)
    asyncio.run(async_pair(keys, agent.pairing, agent.public_key, "stranger"))
    qtbot.waitUntil(lambda: code in tray.request_actions, timeout=STATE_MS)
    tray.request_actions[code][1].trigger()
    qtbot.waitUntil(lambda: code not in tray.request_actions, timeout=STATE_MS)
    assert len(tray.revoke_actions) == 1  # not paired


def test_busy_while_a_controller_runs_a_shard(agent, tray, qtbot, tmp_path) -> None:
    from engine.fleet.client import AgentClient, sha256_file

    set_idle(agent.idle_file, 3600)
    _wait_state(qtbot, tray, "sharing")
    shard = tmp_path / "shard.bin"
    shard.write_bytes(b"flotilla" * 4096)
    sha = sha256_file(shard)
    keys = tray.paired_keys
    done = threading.Event()

    async def run_worker() -> None:
        c = await AgentClient(keys, agent.control, agent.public_key).async_connect()
        try:
            await c.send_shard(shard, "tray-test")
            await c.load(sha, "CPU", free_port())
            await asyncio.to_thread(done.wait, 60)
            await c.unload(sha)
        finally:
            c.close()

    worker = threading.Thread(target=lambda: asyncio.run(run_worker()), daemon=True)
    worker.start()
    try:
        _wait_state(qtbot, tray, "busy")
        assert tray.state.workers == 1 and "1 shard worker" in tray.header.text()
        assert any(t == "Fleet work started" for t, _m in tray.notes)
    finally:
        done.set()
        worker.join(30)
    _wait_state(qtbot, tray, "sharing")


def test_revoke_refuses_the_controller(agent, tray, qtbot) -> None:
    from engine.fleet.client import AgentClient, NotPaired

    (action,) = tray.revoke_actions.values()
    assert "laptop-of-ana" in action.text()
    action.trigger()
    qtbot.waitUntil(lambda: not tray.revoke_actions, timeout=STATE_MS)

    async def connect() -> None:
        c = AgentClient(tray.paired_keys, agent.control, agent.public_key, timeout=5)
        try:
            await c.async_connect()
        finally:
            c.close()

    with pytest.raises(NotPaired):
        asyncio.run(connect())


def test_policy_dialog_saves_the_agents_policy(agent, tray, qtbot) -> None:
    tray.open_policy()
    qtbot.waitUntil(lambda: tray.dialog is not None and tray.dialog.isVisible(), timeout=5000)
    tray.dialog.form.max_ram.setValue(2.5)
    tray.dialog.accept()
    path = agent.config / "sharing_policy.json"
    qtbot.waitUntil(lambda: json.loads(path.read_text()).get("max_ram_gb") == 2.5, timeout=5000)
    tray.dialog.close()


def test_a_stopped_agent_shows_paused(agent, tray, qtbot) -> None:
    agent.stop()
    _wait_state(qtbot, tray, "stopped")
    assert tray.icon_state == "stopped" and "not running" in tray.state.summary
    assert not tray.share_action.isEnabled()
    assert any(t == "The Flotilla agent stopped" for t, _m in tray.notes)

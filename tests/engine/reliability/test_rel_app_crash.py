"""Durability: the app process is killed (SIGKILL) mid-answer; on the next start
the conversation, its settings and every token that was shown are there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openvino")

HERE = Path(__file__).parent
REPO = HERE.parents[2]


@pytest.mark.parametrize("kill_after", [5, 60])
def test_killed_mid_stream_loses_nothing_shown(tmp_path, demo_dir, kill_after):
    from app.settings import AppSettings
    from app.chat.store import ChatStore

    demo_dir("demo")
    data, config = tmp_path / "data", tmp_path / "config"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, str(HERE / "rel_app_chat_child.py"), str(data), str(config)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(REPO))
    shown = ""
    try:
        ready = json.loads(child.stdout.readline())
        assert ready["event"] == "ready"
        for line in child.stdout:
            ev = json.loads(line)
            shown = ev["text"]
            if ev["n"] >= kill_after:
                child.send_signal(signal.SIGKILL)  # mid-answer, no chance to clean up
                break
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL, "the answer ended before the kill"
    assert shown

    store = ChatStore(data)  # "the next start" (also marks the cut answer)
    try:
        (conv,) = store.conversations()
        assert (conv.id, conv.title, conv.system_prompt) == (ready["cid"], "Robots", "Be brief")
        assert conv.sampling == {"temperature": 0.0, "max_tokens": 4000}
        user, answer = store.messages(conv.id)
        assert (user.role, user.text, user.state) == ("user", "Tell me a long story about a robot.", "done")
        assert answer.role == "assistant"
        assert answer.text.startswith(shown), "a token that was shown is missing from the database"
        assert len(answer.text) - len(shown) <= 64  # at most the batch being saved when it died
        assert answer.state == "cancelled" and "interrupted" in answer.note
    finally:
        store.close()
    settings = AppSettings.load(config)
    assert (settings.theme, settings.api_port, settings.last_model) == ("dark", 8123, "demo")

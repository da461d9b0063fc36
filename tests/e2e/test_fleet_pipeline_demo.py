"""`flotilla demo --headless` as a newcomer runs it: exit 0 within 2 minutes
(warm cache), a summary with peers, plan and tok/s, nothing left behind; and
Ctrl-C in the middle of the launch also leaves nothing behind.

Everything the demo starts talks over 127.0.0.1 only (agents bound there,
mDNS on 127.0.0.1 only). Leftovers are looked for in every process's
command line and environment: the demo's temp folder names them all.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("openvino")
pytest.importorskip("zeroconf")

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env.pop("FLOTILLA_CONFIG", None)
    env.pop("FLOTILLA_DATA", None)
    return env


def _processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line or environment mentions text."""
    hits = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmd or text in env:
            hits.append(f"{pid}: {cmd[:160]}")
    return hits


def _no_leftovers(root: str, within: float = 5.0) -> None:
    end = time.time() + within
    while _processes_mentioning(root) and time.time() < end:
        time.sleep(0.1)
    assert not _processes_mentioning(root), f"left behind: {_processes_mentioning(root)}"
    assert not Path(root).exists(), "the demo's temp folder was not removed"


def test_demo_headless_exits_0_within_2_minutes(tmp_path):
    out = tmp_path / "summary.json"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "engine.cli.demo_cmd", "--headless", "--json", str(out)],
                         env=_env(), cwd=REPO, capture_output=True, text=True, timeout=150)
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    assert wall < 120, f"the demo took {wall:.0f} s"
    s = json.loads(out.read_text())
    assert len(s["peers"]) == 2 and {p["address"] for p in s["peers"]} == {"127.0.0.1"}
    assert s["stages"] == 2 and [st["layers"] for st in s["plan"]] == [[0, 4], [4, 8]]
    assert len({st["node_id"] for st in s["plan"]}) == 2
    assert s["tokens"] >= 1 and s["decode_tok_s"] >= 0 and s["events"] == []
    for line in ("== flotilla demo summary ==", "peers: 2", "plan: 2 stages of demo", "tok/s", "demo: ok"):
        assert line in res.stdout, res.stdout
    assert "found vm" in res.stderr or "found " in res.stderr
    assert "pairing with node" in res.stderr and "paired with both agents" in res.stderr
    _no_leftovers(s["root"])
    print(f"\ndemo: {wall:.1f} s wall; {s['decode_tok_s']} tok/s; timings {s['timings_s']}")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c_at(trigger: str) -> tuple[int, list[str], str]:
    """Start the demo, send it SIGINT as soon as a stderr line starts with trigger; its exit
    code, its stderr lines, its temp folder (after checking nothing of it is left)."""
    # preexec_fn: SIGINT as a terminal leaves it. A suite started in the background by a shell without
    # job control inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored: the demo would
    # then never see this Ctrl-C (that, not the demo, failed a backgrounded CI run).
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.demo_cmd", "--headless", "--max-tokens", "2000"],
                            env=_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)
    lines: list[str] = []
    root: list[str] = []
    hit = threading.Event()

    def pump() -> None:
        for line in proc.stderr:
            if line.startswith(trigger) and not hit.is_set():
                proc.send_signal(signal.SIGINT)  # from the reader itself: no thread hand-over delay
                hit.set()
            lines.append(line.rstrip())
            m = re.search(r"config and logs in (\S+)", line)
            if m:
                root.append(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert hit.wait(90), "\n".join(lines[-20:])
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert root, "\n".join(lines[-20:])
    _no_leftovers(root[0], within=8.0)
    return code, lines, root[0]


def test_demo_ctrl_c_during_launch_leaves_nothing_behind():
    # The Ctrl-C is sent the moment the launcher starts the stage workers. The rest of a demo takes
    # about a second after that line, so on a loaded machine the signal can land after the demo has
    # finished: such an attempt (exit 0, nothing left behind either) is retried, twice at most.
    for _ in range(3):
        code, lines, _root = _ctrl_c_at("starting stage")
        if code != 0:
            break
    assert code == 130, "\n".join(lines[-20:])
    assert lines[-1] == "interrupted", lines[-5:]

"""`flotilla serve --host <LAN address>` with no key, tried from another PC: two network
namespaces on a private bridge (engine/bench/_netns.py; nothing touches the root namespace).
The server, in one, binds its LAN address; it generates a key into its keys folder (mode
0600) and names it on stderr. A client in the other namespace gets 401 with OpenAI's error
JSON without the key, 200 with it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CLIENT = r"""
import json, sys, urllib.request, urllib.error
url, key = sys.argv[1], sys.argv[2]
out = {}
for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                      ("key", {"Authorization": "Bearer " + key})):
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=20) as r:
            out[name] = [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        out[name] = [e.code, json.loads(e.read())]
print(json.dumps(out))
"""


def test_lan_bind_without_a_key_gets_a_generated_one_and_refuses_requests_without_it(tmp_path):
    from engine.bench._netns import NetLab, available
    from engine.models.demo import ensure_demo

    if available():  # a failure, not a skip: CI runs as root with iproute2
        pytest.fail(f"network namespaces unavailable: {available()}")
    ensure_demo("demo")
    config = tmp_path / "config"
    env = dict(os.environ, FLOTILLA_CONFIG=str(config), PYTHONPATH=str(ROOT))
    env.pop("FLOTILLA_API_KEY", None)
    with NetLab(["client", "server"]) as lab:
        host = lab.address("server")
        server = subprocess.Popen([*lab.exec_prefix("server"), sys.executable, "-m", "engine.cli.main", "serve",
                                   "--model", "demo", "--host", host, "--port", "8123"],
                                  stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        try:
            lines = []
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                line = server.stderr.readline()
                if not line:
                    break
                lines.append(line.strip())
                if line.startswith("serving demo"):
                    break
            assert lines and lines[-1].startswith("serving demo"), lines[-20:]
            key_file = config / "api_key.secret"
            key = key_file.read_text().strip()
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            notice = next(x for x in lines if x.startswith("serving beyond this PC"))
            assert f"{host}:8123" in notice and key in notice and "generated now" in notice
            res = subprocess.run([*lab.exec_prefix("client"), sys.executable, "-c", CLIENT, f"http://{host}:8123",
                                  key], capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr[-2000:]
            got = json.loads(res.stdout)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    for name in ("none", "wrong"):
        code, body = got[name]
        assert code == 401 and body["error"]["code"] == "invalid_api_key", (name, got[name])
    code, body = got["key"]
    assert code == 200 and [m["id"] for m in body["data"]] == ["demo"]

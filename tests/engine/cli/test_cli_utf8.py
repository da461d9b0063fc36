"""The CLI writes UTF-8 whatever the pipe's encoding: a pipe on Windows is cp1252, which cannot
encode the U+FFFD a byte-level tokenizer decodes a partial character to (nor most of what a
model says). PYTHONIOENCODING=cp1252 makes this Linux run's pipes what Windows' would be."""

from __future__ import annotations

import os
import subprocess
import sys

from cli_helpers import REPO

PARTIAL = "\ufffd".encode("utf-8")  # what the demo tokenizer decodes a cut multi-byte character to


def _run(*args: str, encoding: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(PYTHONIOENCODING=encoding, HF_HUB_OFFLINE="1")
    env.pop("PYTHONUTF8", None)
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True, timeout=300,
                          env=env, cwd=REPO)  # bytes: what really went through the pipe


def test_a_partial_character_of_the_answer_goes_through_a_cp1252_pipe(demo_folder):
    # Greedy, so the answer is always the same; the random-weight build's answer holds cut
    # characters (asserted below, so the test cannot pass without going through the path it is
    # about; the trained demo writes plain ASCII Python).
    res = _run("chat", "--model", "demo-random", "-p", "Hi", "--max-tokens", "48", "--temperature", "0", encoding="cp1252")
    assert res.returncode == 0, res.stderr.decode("utf-8", "replace")[-2000:]
    assert PARTIAL in res.stdout, "the demo answer has no partial character any more: pick another prompt"
    res.stdout.decode("utf-8")  # all of it is valid UTF-8
    assert "tok/s" in res.stderr.decode("utf-8")


def test_an_error_naming_a_non_latin_path_goes_through_an_ascii_pipe():
    res = _run("chat", "--model", "/nonexistent/модель-模型", "-p", "x", encoding="ascii")
    err = res.stderr.decode("utf-8")
    assert res.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("flotilla: error:") and "модель-模型" in err

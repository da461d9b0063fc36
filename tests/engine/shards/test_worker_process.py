"""Starting a worker and learning its address (engine/shards/worker_process.py), with stand-in
children: the endpoint of the "bound" line, and one clear error, with its code and the log's
last line, for a child that exits, stays silent or names no address."""

from __future__ import annotations

import sys

import pytest

from engine.shards.worker_process import WorkerStartError, parse_bound, read_bound, spawn


def _child(tmp_path, code: str, name: str = "w"):
    log = tmp_path / f"{name}.log"
    return spawn([sys.executable, "-c", code], log), log


def test_the_bound_line_names_the_endpoint():
    assert parse_bound(b'{"event": "bound", "endpoint": "tcp://127.0.0.1:5555", "pid": 7}\n') \
        == "tcp://127.0.0.1:5555"
    assert parse_bound("not json") is None and parse_bound(b"[1, 2]") is None and parse_bound(b"{}") is None


def test_a_started_child_reports_its_endpoint_and_imports_this_checkout(tmp_path):
    proc, log = _child(tmp_path, "import json, engine; print(json.dumps({'event': 'bound', "
                                 "'endpoint': 'tcp://127.0.0.1:1'}), flush=True)")
    try:
        assert read_bound(proc, "stage 0", log, timeout=60) == "tcp://127.0.0.1:1"
    finally:
        proc.wait(30)


@pytest.mark.parametrize("code,want,words", [
    ("import sys; print('boom from the child', file=sys.stderr); sys.exit(3)", "exited",
     "exited with code 3 while starting: boom from the child"),
    ("print('hello', flush=True)", "no_address", "printed no address"),
])
def test_a_child_that_does_not_start_is_one_error_with_a_code(tmp_path, code, want, words):
    proc, log = _child(tmp_path, code)
    with pytest.raises(WorkerStartError) as e:
        read_bound(proc, "stage 1", log, timeout=60)
    proc.wait(30)
    assert e.value.code == want and words in str(e.value) and str(log) in str(e.value)


def test_a_silent_child_times_out(tmp_path):
    proc, log = _child(tmp_path, "import time; time.sleep(30)")
    try:
        with pytest.raises(WorkerStartError) as e:
            read_bound(proc, "stage 2", log, timeout=0.5)
        assert e.value.code == "timeout" and "stage 2 did not start within" in str(e.value)
    finally:
        proc.kill()
        proc.wait(30)

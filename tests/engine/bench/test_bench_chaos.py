"""`flotilla bench chaos` at a tiny size: every request is counted and the verdict follows the figures.

No reliability or speed assertions on the run itself (a loaded machine may miss the
goal): only that the figures add up and "passed" agrees with "failures".
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")
pytest.importorskip("zmq")

from engine.bench import chaos  # noqa: E402

TINY = ["--stages", "2", "--streams", "2", "--max-tokens", "12", "--stream-timeout", "20"]


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    chaos.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def _good() -> dict:
    """Figures of a run that met the goal."""
    return {"submitted": 10, "completed": 10, "failed": 0, "unfinished": 0, "identical": 10,
            "duplicated_tokens": 0, "lost_tokens": 0, "mismatched_tokens": 0, "usage_mismatches": 0,
            "kills": 2, "unrecovered_kills": 0, "max_recovery_s": 1.2}


def _check_consistent(out: dict, goal: float) -> None:
    json.dumps(out, allow_nan=False)
    assert out["submitted"] == out["completed"] + out["failed"] + out["unfinished"]
    assert out["requests"] == out["completed"] + out["failed"]
    assert 0 <= out["identical"] <= out["requests"]
    assert out["recovery_goal_s"] == goal
    assert isinstance(out["passed"], bool) and isinstance(out["failures"], list)
    assert out["passed"] is (not out["failures"])
    if out["passed"]:
        assert out["stage_logs"] is None
    else:  # a failed run keeps the stages' logs to read why; the test cleans them up
        assert (Path(out["stage_logs"]) / "stage-0.log").is_file()
        shutil.rmtree(out["stage_logs"])
    assert out["failures"] == chaos.judge(out, goal)
    assert len(out["recovery_s"]) == out["kills"]
    assert out["unrecovered_kills"] == sum(r is None for r in out["recovery_s"])


def test_defaults():
    a = _args([])
    assert chaos.RECOVERY_GOAL_S == 5.0 and a.recovery_goal == chaos.RECOVERY_GOAL_S
    assert a.drain_timeout == chaos.DRAIN_TIMEOUT_S


def test_judge_passes_a_good_run_and_names_each_miss():
    assert chaos.judge(_good()) == []
    cases = {
        "failed": (dict(completed=9, failed=1), "failed"),
        "unfinished": (dict(completed=9, unfinished=1), "still running"),
        "duplicated": (dict(duplicated_tokens=3), "duplicated"),
        "lost": (dict(lost_tokens=2), "lost"),
        "mismatched": (dict(mismatched_tokens=1, identical=9), "mismatched"),
        "usage": (dict(usage_mismatches=1), "usage"),
        "slow": (dict(max_recovery_s=5.0), "max recovery"),
        "unrecovered": (dict(unrecovered_kills=1, max_recovery_s=None), "not followed by a successful recovery"),
        "no kill": (dict(kills=0, max_recovery_s=0.0), "no stage was killed"),
        "counts": (dict(submitted=11), "do not add up"),
    }
    for name, (change, words) in cases.items():
        failures = chaos.judge({**_good(), **change})
        assert failures and any(words in f for f in failures), (name, failures)
    assert chaos.judge({**_good(), "max_recovery_s": 1.2}, recovery_goal_s=1.0)
    assert chaos.judge({**_good(), "max_recovery_s": 1.2}, recovery_goal_s=1.3) == []


def test_chaos_fails_an_impossible_recovery_goal():
    goal = 0.0001
    out = chaos.run(_args([*TINY, "--duration", "4", "--kill-every", "1.5", "--recovery-goal", str(goal),
                           "--drain-timeout", "30"]), lambda _line: None)
    _check_consistent(out, goal)
    assert out["kills"] >= 1 and out["submitted"] >= 1
    assert out["passed"] is False
    if out["unrecovered_kills"]:
        assert out["max_recovery_s"] is None
    else:
        assert out["max_recovery_s"] > goal
        assert any("max recovery" in f for f in out["failures"])


def test_chaos_counts_requests_still_running_at_the_end():
    # No drain time: whatever is running when the chaos stops is unfinished, and counted.
    out = chaos.run(_args([*TINY, "--max-tokens", "160", "--duration", "2", "--kill-every", "1000",
                           "--drain-timeout", "0"]), lambda _line: None)
    _check_consistent(out, chaos.RECOVERY_GOAL_S)
    assert out["kills"] == 0 and out["unfinished"] >= 1
    assert out["passed"] is False
    assert any("still running" in f for f in out["failures"])
    assert any("no stage was killed" in f for f in out["failures"])

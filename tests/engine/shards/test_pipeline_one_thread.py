"""A shard compiled for one thread (how `flotilla bench pipeline` pins each stage to a core)
runs on this machine's CPU at its default precision: on AMX Xeons OpenVINO 2026.4 killed such a
process with SIGFPE until compile_config stopped one thread from computing in bf16. In a child
process, so a crash is this test's failure and not the suite's."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("openvino")

CHILD = """
import sys, numpy as np
from engine.shards.runtime import ShardRunner
r = ShardRunner(sys.argv[1], "CPU", config={"INFERENCE_NUM_THREADS": 1})
s = r.new_stream()
ids = np.array([[1, 2, 3]], np.int64)
out = s.run({"input_ids": ids, "attention_mask": np.ones((1, 3), np.int64), "position_ids": np.arange(3)[None]})
print(sorted(out))
"""


def test_a_one_thread_shard_runs_at_the_default_precision(demo_dir):
    from engine.shards.export import ensure_shard

    shard = ensure_shard(demo_dir("demo"), 0, 2)
    res = subprocess.run([sys.executable, "-c", CHILD, str(shard.path)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    assert "hidden_states_out" in res.stdout

"""An exporter killed mid-way (SIGKILL: the OOM killer does the same) leaves no
half shard in the cache, and the next export redoes it and gives a working one.

The exporter runs in a child process on a private cache. It is killed once as
soon as its temporary folder shows up in the cache root, once when it has
written everything (shard.json included) and is about to rename the folder
into place: the child holds that rename, so the kill lands there every time.
The temporary folder is found from the cache root listing (dot entries), not
from the exporter's naming.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino")
torch = pytest.importorskip("torch")

from engine.shards.export import MANIFEST, _load_hf, ensure_shard  # noqa: E402
from engine.shards.runtime import ShardRunner  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
LAYERS = 8  # the "demo" model: the whole model in one shard (first and last stage)

CHILD = r"""
import os, sys, time
from pathlib import Path

cache, model, hold_flag = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
real = {"replace": os.replace, "rename": os.rename}


def holding(name):
    def move(src, dst, *a, **k):
        s = Path(src)
        if s.parent == cache and s.name.startswith("."):  # the finished export, renamed into place
            hold_flag.write_text(str(s))
            time.sleep(3600)
        return real[name](src, dst, *a, **k)
    return move


os.replace, os.rename = holding("replace"), holding("rename")
from engine.shards.export import ensure_shard

ensure_shard(model, 0, int(sys.argv[4]), num_layers_total=int(sys.argv[4]), precision="f32", cache=cache)
"""


def _temp_entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(".")) if root.exists() else []


def _finished_entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _kill_exporter(root: Path, model: Path, hold_flag: Path, when: str) -> list[Path]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(model), str(hold_flag), str(LAYERS)],
                            env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready = hold_flag.exists() if when == "written" else bool(_temp_entries(root))
            if ready or proc.poll() is not None:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"the exporter ended by itself (code {proc.returncode}):\n{proc.stderr.read()}"
        assert ready, "the exporter never got there"
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return _temp_entries(root)


def test_killed_export_leaves_no_half_shard_and_is_redone(tmp_path, demo_dir):
    model = demo_dir("demo")
    root = tmp_path / "shards"

    # Killed early: only its temporary folder is left.
    early = _kill_exporter(root, model, tmp_path / "held-1", "started")
    assert early, "the killed exporter's temporary folder should be what is left"
    assert _finished_entries(root) == [], "a killed export left something that looks like a cache entry"

    # Killed with everything written, shard.json too, just before the rename: the
    # dangerous case. Its start cleaned up the first one (whose exporter is gone).
    late = _kill_exporter(root, model, tmp_path / "held-2", "written")
    assert not any(p.exists() for p in early), "the next export did not remove a dead exporter's folder"
    assert late and any((p / MANIFEST).exists() for p in late)
    assert _finished_entries(root) == [], "a killed export left something that looks like a cache entry"
    for p in late:
        (p / "never-used").write_text("a stale temporary folder of a killed exporter")

    # The next export redoes it, never from the dead exporter's folder, and removes that.
    info = ensure_shard(model, 0, LAYERS, num_layers_total=LAYERS, precision="f32", cache=root)
    shard = Path(info.path)
    assert shard.parent == root and not shard.name.startswith(".")
    assert not (shard / "never-used").exists(), "the killed exporter's folder was used"
    assert not any(p.exists() for p in late), "the stale temporary folder was not cleaned up"
    assert _finished_entries(root) == [shard] and _temp_entries(root) == []

    # And it works: the last position's logits are transformers' own.
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model))("The sea was calm that night")["input_ids"]
    n = len(ids)
    stream = ShardRunner(info, exact=True).new_stream()
    feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None]}
    if "logits_to_keep" in stream.runner.input_names:
        feed["logits_to_keep"] = np.array([1], np.int64)
    got = stream.run(feed)["logits"][0, -1]
    with torch.no_grad():
        want = _load_hf(model)(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

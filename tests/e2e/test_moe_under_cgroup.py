"""`flotilla chat --engine moe` on a bf16 MoE checkpoint bigger than the memory it runs in.

A random-weight Qwen3-MoE checkpoint of 1.03 GB (bf16, 4 safetensors files with an index;
hidden 512, 10 layers x 32 experts of width 1024, top-4: 1.0 GB of experts) is converted to
an expert store and chatted with by the real CLI, one process inside a cgroup-v1 memory group
capped at 0.7 x the checkpoint -- the whole Python process, libraries and page cache included
(the first conversion runs under the cap too). The engine picks its cache budget itself from
what the cap leaves once the resident weights and the KV reserve are in.

Checked: the answer has its 16 tokens, nothing was OOM-killed, the store keeps the
checkpoint's bf16 expert bytes, and the group's peak stayed under a cap below the checkpoint.
Without cgroup-v1 memory groups the test fails (CgroupError), it never runs uncapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOKENS = 16
CAP_FRACTION = 0.7


def capped_spec():
    from engine.bench._checkpoint import QWEN3_30B_A3B

    return QWEN3_30B_A3B.scaled(name="qwen3-moe-capped-test", hidden_size=512, num_layers=10, num_heads=8,
                                num_kv_heads=2, head_dim_override=64, num_experts=32, top_k=4,
                                expert_intermediate=1024, intermediate_size=1024, vocab_size=4096,
                                max_position_embeddings=4096, max_file_bytes=300 * 10**6, init_std=0.05)


def test_moe_chat_runs_under_a_cap_below_its_checkpoint(tmp_path):
    from engine.bench._cgroup import MemoryGroup, require_v1
    from engine.bench._checkpoint import checkpoint_bytes, ensure_checkpoint
    from engine.moe.store import BLOB_FILE, INDEX_FILE

    require_v1()  # CgroupError (a failure, not a skip) without cgroup-v1 memory groups
    spec = capped_spec()
    path = ensure_checkpoint(spec)
    ckpt = checkpoint_bytes(path)
    assert len(list(path.glob("*.safetensors"))) >= 2 and ckpt > 10**9
    env = dict(os.environ, FLOTILLA_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "engine.cli.main", "chat", "--engine", "moe", "--model", str(path),
            "-p", "Tell me a story", "--max-tokens", str(TOKENS), "--context", "1024", "--max-concurrent", "2"]
    with MemoryGroup("moe-chat", int(CAP_FRACTION * ckpt)) as group:
        proc = group.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=600)
        stats = group.stats()
    assert proc.returncode == 0, out[-3000:]
    assert stats.oom_kills == 0, stats
    assert stats.limit_bytes < ckpt and stats.max_usage_bytes <= stats.limit_bytes
    store = next((tmp_path / "cache" / "moe-store").iterdir())
    index = json.loads((store / INDEX_FILE).read_text())
    assert index["dtype"] == "bf16"
    assert (store / BLOB_FILE).stat().st_size == spec.expert_bytes  # bf16, no padding at these shapes
    assert f"[{TOKENS} tokens" in out and "· length]" in out, out[-2000:]
    print(f"\nmoe chat under a {stats.limit_bytes / 1e6:.0f} MB cap (checkpoint {ckpt / 1e6:.0f} MB): "
          f"peak {stats.max_usage_bytes / 1e6:.0f} MB, failcnt {stats.failcnt}")

"""The sparse engine on a bf16 Llama-shaped checkpoint bigger than the memory it runs in.

A random-weight checkpoint of 1.6 GB (bf16, safetensors files with an index; hidden 2048,
FFN 12288 wide, 10 layers, 4 attention heads: 1.5 GB of FFN weights; at hidden 2048 a bf16
neuron bundle is exactly 3 pages, so the store needs no padding, as at Llama-3.1-8B's 4096) goes through everything a first start
does -- the neuron store is built, the thresholds and predictors calibrated (layer by layer
from the mmap'd checkpoint, on a short text to keep the test short), attention and
embeddings loaded -- and then answers a chat, all in one process inside a cgroup-v1 memory
group capped at 0.9 x the checkpoint (the Python process, libraries and page cache
included). The engine sets its neuron cache from what the cap leaves once it has kept room
for its working memory and its own code. At this size the fixed part -- Python and torch,
the resident weights, one 512-token prefill chunk with its layer of rows -- is over half
the checkpoint, so a lower cap leaves no room for a cache (and the engine says so); at 8B
the same fixed part is a tenth of the checkpoint.

Checked: 16 tokens, no OOM kill, the group's cap below the checkpoint, the store's bytes
on disk equal to the checkpoint's FFN bytes (bf16, +-5 %). Without cgroup-v1 memory groups
the test fails (CgroupError), it never runs uncapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOKENS = 16
CAP_FRACTION = 0.9
TEXT = ("The sparse engine keeps attention and embeddings in memory and reads the rows of the feed-forward "
        "layers it needs from the disk, one neuron at a time, guided by a small predictor. ") * 6

DRIVER = """
import json, sys
from pathlib import Path
from engine.sparse.engine import SparseConfig, SparseEngine
from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams
path, text = sys.argv[1], Path(sys.argv[2])
with SparseEngine(Path(path), "capped", SparseConfig(text=text, context_length=512)) as eng:
    rid = eng.submit(GenerateRequest("a", messages=(ChatMessage("user", "Tell me a story"),),
                                     sampling=SamplingParams(max_tokens=%d, ignore_eos=True)))
    events = list(eng.stream(rid, timeout=600))
    stats = eng.stats()
print(json.dumps({"tokens": sum(len(e.token_ids) for e in events), "error": events[-1].error,
                  "cache_budget_bytes": stats["cache_budget_bytes"]}))
""" % TOKENS


def capped_spec():
    from engine.bench._checkpoint import LLAMA_3_1_8B

    return LLAMA_3_1_8B.scaled(name="llama-sparse-capped-test", hidden_size=2048, intermediate_size=12288,
                               num_layers=10, num_heads=4, num_kv_heads=2, head_dim_override=128, vocab_size=4096,
                               max_position_embeddings=4096, rope_scaling=None, max_file_bytes=400 * 10**6)


def test_sparse_chat_runs_under_a_cap_below_its_checkpoint(tmp_path):
    from engine.bench._cgroup import MemoryGroup, require_v1
    from engine.bench._checkpoint import checkpoint_bytes, ensure_checkpoint

    require_v1()  # CgroupError (a failure, not a skip) without cgroup-v1 memory groups
    spec = capped_spec()
    path = ensure_checkpoint(spec)
    ckpt = checkpoint_bytes(path)
    assert len(list(path.glob("*.safetensors"))) >= 2 and ckpt > 1.5e9
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT, encoding="utf-8")
    env = dict(os.environ, FLOTILLA_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    with MemoryGroup("sparse-chat", int(CAP_FRACTION * ckpt)) as group:
        proc = group.popen([sys.executable, "-c", DRIVER, str(path), str(text)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=900)
        stats = group.stats()
    assert proc.returncode == 0, (stats, err[-3000:])
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] is None and result["tokens"] == TOKENS, result
    assert stats.oom_kills == 0 and stats.limit_bytes < ckpt, stats
    ffn = spec.num_layers * 3 * spec.hidden_size * spec.intermediate_size * 2  # bf16
    store = [p for p in (tmp_path / "cache" / "sparse").rglob("*") if p.is_file() and p.suffix == ".bin"]
    on_disk = sum(p.stat().st_size for p in store)
    assert abs(on_disk - ffn) <= 0.05 * ffn, (on_disk, ffn, [p.name for p in store])
    print(f"\nsparse chat under a {stats.limit_bytes / 1e6:.0f} MB cap (checkpoint {ckpt / 1e6:.0f} MB): "
          f"peak {stats.max_usage_bytes / 1e6:.0f} MB, cache {result['cache_budget_bytes'] / 1e6:.0f} MB")

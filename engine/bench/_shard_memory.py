"""A shard worker's memory, measured beside what the planner predicts for it.

Each shard runs alone in a fresh process (`python -m engine.bench._shard_memory`),
compiled as a worker compiles it (ShardRunner), and is fed one stream's worth of
work the way a served prompt feeds it: prefill chunks of varied sizes (1 to 128
tokens: the tail chunks of prompts and speculative verifies) up to the context, one
full PREFILL_CHUNK at the end of the context (the plan's activation peak), then
decode steps. Its anonymous memory (RssAnon) is read after every call. The plan
side is `evaluate_plan` of that one stage on a CPU peer with room to spare, at the
same precision, context and one stream: `Stage.process_bytes`.

Varied chunk sizes matter for MoE shards: each routed expert's MatMul sees a
different batch every call, and the CPU plugin's memory grows with the mix
(planner.memory.EXPERT_COPIES); a fixed chunk size would hide it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine.bench._local_memory import proc_status

SMALL_CHUNK_MAX = 128  # largest of the varied prefill chunks


def schedule(context: int, chunk: int, decode: int, seed: int = 0) -> list[int]:
    """Token counts of each call: varied chunks, one `chunk` ending the context, then decode steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    big = min(chunk, context - decode)
    calls, pos = [], 0
    while pos < context - decode - big:
        n = int(min(rng.integers(1, SMALL_CHUNK_MAX + 1), context - decode - big - pos))
        calls.append(n)
        pos += n
    return calls + [big] + [1] * decode


def _anon_bytes() -> int:
    return proc_status().get("RssAnon", 0)


def _child(shard: Path, calls: list[int], seed: int) -> dict[str, Any]:
    """Run in the measuring process: load, feed `calls`, anonymous memory after each."""
    import numpy as np

    from engine.shards.runtime import ShardRunner

    before = _anon_bytes()
    runner = ShardRunner(shard)
    stream = runner.new_stream()
    loaded = _anon_bytes()
    info = runner.info
    rng = np.random.default_rng(seed)
    after, pos = [], 0
    for n in calls:
        feed = {"attention_mask": np.ones((1, pos + n), np.int64),
                "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None]}
        if info.first:
            feed["input_ids"] = rng.integers(3, info.vocab_size, (1, n), dtype=np.int64)
        else:  # hidden states as a previous stage sends them (RMS ~1 after its residual adds)
            feed["hidden_states"] = rng.standard_normal((1, n, info.hidden_size)).astype(np.float32)
        stream.run(feed)
        pos += n
        after.append(_anon_bytes())
    return {"anon_before_load_bytes": before, "anon_after_load_bytes": loaded,
            "anon_after_call_bytes": after, "anon_peak_bytes": max([loaded, *after])}


def measure(shard: Path, calls: list[int], seed: int = 0, timeout_s: float = 1800) -> dict[str, Any]:
    """Measure one shard in its own process (nothing else loaded there)."""
    cmd = [sys.executable, "-m", "engine.bench._shard_memory", str(shard), "--calls", ",".join(map(str, calls)),
           "--seed", str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"shard memory run of {shard.name} failed ({done.returncode}): {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def planned(model_path: Path, ranges: list[tuple[int, int]], precision: str, context: int) -> list[dict[str, int]]:
    """The planner's memory for each stage of these ranges, one CPU peer each, one stream."""
    from engine.models import profile_model
    from engine.planner.plan import DeviceProfile, PeerProfile, PlanModel, PlanRequest
    from engine.planner.validate import evaluate_plan

    model = PlanModel.from_profile(profile_model(model_path))
    peers = [PeerProfile(f"p{i}", f"p{i}", (DeviceProfile("CPU", "CPU"),), 1 << 50) for i in range(len(ranges))]
    request = PlanRequest(context_length=context, streams=1, weight_precision=precision, os_reserve_bytes=0)
    plan = evaluate_plan([(p.peer_id, "CPU", s, e) for p, (s, e) in zip(peers, ranges)], model, peers, request)
    experts = model.expert_weight_bytes(precision)
    return [{"process_bytes": st.process_bytes, "weight_bytes": st.weight_bytes, "mapped_bytes": st.mapped_bytes,
             "kv_bytes": st.kv_bytes, "runtime_reserve_bytes": st.runtime_reserve_bytes,
             "expert_bytes": sum(experts[st.start:st.end])} for st in plan.stages]


def stage_memory(info: Any, plan: dict[str, int], calls: list[int]) -> dict[str, Any]:
    """One shard: measured in its own process, beside its stage's planned memory."""
    m = measure(Path(info.path), calls)
    shard_bytes = sum(f.stat().st_size for f in Path(info.path).glob("*.bin"))
    peak = m["anon_peak_bytes"]
    return {"layers": [info.start, info.end], "precision": info.precision, "shard_bytes": shard_bytes,
            "manifest_expert_bytes": info.expert_bytes, "planned": plan, "measured": m,
            "plan_vs_anon": round(plan["process_bytes"] / peak - 1, 4) if peak else None,
            "anon_over_shard": round(peak / shard_bytes, 3) if shard_bytes else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shard", type=Path)
    ap.add_argument("--calls", required=True, help="comma-separated token counts of each call")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(_child(a.shard, [int(x) for x in a.calls.split(",") if x], a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`flotilla bench shards`: decode latency of a split model against the whole one.

The same random-weight Llama (built from a config, big enough that per-call
overhead does not dominate) is exported three ways with `ensure_shard`:
  whole        one shard [0, L) with fused stateful KV (beam_idx)
  split        N contiguous shards with fused stateful KV
  split_nofix  the same N shards exported with fuse_beam_idx=False
All compiled models live in ONE process and hand hidden states to each other
directly (no network): this isolates what cutting the graph costs. Every
variant prefills the same `--context` tokens, then decodes; the variants
alternate step by step (the order rotates every step) so drift of this shared
machine hits all of them alike. A repeat's figure is the median step time
after warm-up steps; reported figures are medians over repeats.

Reported: split_over_whole (goal <= 1.05; the paper lost ~15% without the
fix), split_over_whole_without_fix (unfused split vs fused whole),
fused_sdpa_all_shards (every fused shard's compiled model has one fused
SDPA-with-KV-cache node per layer), absolute ms, the model size, and the
runtime op counts of one fused and one unfused shard.

`--arch qwen3_moe` runs the same on a Qwen3-MoE built from its config (experts with
Qwen3-30B-A3B's expert width, 768). Then, for each of `--memory-weights`, the whole
and the split shards are exported at that precision and each runs alone in its own
process (engine/bench/_shard_memory.py): its anonymous memory after every call of a
served stream's worth of varied prefill chunks and decode steps, beside the planner's
memory for that stage (`memory` in the JSON; plan_vs_anon = planned / measured - 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

NAME = "shards"
HELP = "pipeline shards: split-model decode latency vs the whole model (fused stateful KV on/off)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8 quick, 16 full)")
    p.add_argument("--inter", type=int, default=None, help="FFN width (default 2.75 x hidden)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="K/V heads (default 4, GQA)")
    p.add_argument("--stages", type=int, default=2, help="shards of the split model (default 2)")
    p.add_argument("--context", type=int, default=256, help="prefill tokens before decoding (default 256)")
    p.add_argument("--tokens", type=int, default=None, help="timed decode steps per repeat (default 16 quick, 32 full)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps per repeat (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="repeats (default 5 quick, 9 full)")
    p.add_argument("--threads", type=int, default=0, help="INFERENCE_NUM_THREADS per compiled model (0 = plugin default)")
    p.add_argument("--exact", action="store_true", help="f32 inference and KV cache precision hints")
    p.add_argument("--arch", choices=ARCHS, default="llama",
                   help="model family: llama (dense) or qwen3_moe (routed experts; default llama)")
    p.add_argument("--experts", type=int, default=32, help="qwen3_moe: routed experts per layer (default 32)")
    p.add_argument("--top-k", type=int, default=4, help="qwen3_moe: experts per token (default 4)")
    p.add_argument("--expert-inter", type=int, default=768,
                   help="qwen3_moe: one expert's FFN width (default 768, as Qwen3-30B-A3B)")
    p.add_argument("--memory-weights", default="fp16,int8",
                   help="weight precisions whose shards' memory is measured against the plan "
                        "(comma-separated; empty: none; default fp16,int8)")
    p.add_argument("--memory-context", type=int, default=2048,
                   help="tokens of the stream fed to each shard in the memory runs (default 2048)")
    p.add_argument("--memory-decode", type=int, default=16, help="decode steps ending each memory run (default 16)")


ARCHS = ("llama", "qwen3_moe")


def moe_recipe(hidden: int, layers: int, experts: int, top_k: int, expert_inter: int,
               heads: int = 16, kv_heads: int = 4):
    """A Qwen3-MoE built from its config with random weights (demo tokenizer); every layer sparse."""
    from engine.models.demo import DemoRecipe

    return DemoRecipe(
        f"bench-qwen3moe-h{hidden}-l{layers}-e{experts}-k{top_k}-i{expert_inter}-a{heads}-kv{kv_heads}",
        "Qwen3MoeConfig",
        dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False,
             hidden_size=hidden, intermediate_size=expert_inter, moe_intermediate_size=expert_inter,
             num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
             head_dim=hidden // heads, norm_topk_prob=True, rms_norm_eps=1e-6),
        seed=37, description=f"benchmark Qwen3-MoE, {layers} layers x {experts} experts (top-{top_k})",
        tokenizer_of="demo",
    )


def dense_recipe(hidden: int, layers: int, inter: int | None = None, heads: int = 16, kv_heads: int = 4):
    """A compute-bound Llama built from its config with random weights (demo tokenizer)."""
    from engine.models.demo import DemoRecipe

    inter = inter or int(round(hidden * 2.75 / 64)) * 64
    return DemoRecipe(
        f"bench-llama-h{hidden}-l{layers}-i{inter}-a{heads}-kv{kv_heads}", "LlamaConfig",
        dict(initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=False,
             hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5),
        seed=31, description=f"benchmark Llama, {layers} layers, hidden {hidden} (random weights)",
        tokenizer_of="demo",
    )


def model_summary(path, recipe) -> dict[str, Any]:
    """Size of a built model: parameters and f32 weight bytes (from safetensors)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(path) / "config.json").read_text())
    weights = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    return {"recipe": recipe.demo_id, "architecture": cfg.get("model_type"),
            "hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
            "intermediate": cfg["intermediate_size"], "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"], "vocab": cfg["vocab_size"],
            "params_m": round(weights / 4 / 1e6, 1), "f32_weights_mb": round(weights / 1e6, 1),
            "experts": cfg.get("num_experts") or cfg.get("num_local_experts"),
            "experts_per_token": cfg.get("num_experts_per_tok")}


def chain_step(streams, x, mask, positions) -> dict:
    """One chunk through every stage of a chain; returns the last stage's outputs."""
    import numpy as np

    out: dict = {}
    for i, stream in enumerate(streams):
        feed = {"attention_mask": mask, "position_ids": positions}
        feed["input_ids" if i == 0 else "hidden_states"] = x
        out = stream.run(feed)
        x = out.get("hidden_states_out")
    assert x is None and "next_token" in out
    return {"next_token": np.asarray(out["next_token"])}


class Chain:
    """One variant: its compiled shards and one stream (request + KV state) per shard."""

    def __init__(self, name: str, runners: list):
        self.name = name
        self.runners = runners
        self.streams = [r.new_stream() for r in runners]
        self.length = 0
        self.next = 0

    def reset(self) -> None:
        for s in self.streams:
            s.reset()
        self.length = 0

    def prefill(self, ids) -> None:
        import numpy as np

        n = len(ids)
        out = chain_step(self.streams, np.array([ids], np.int64), np.ones((1, n), np.int64),
                         np.arange(n, dtype=np.int64)[None])
        self.length, self.next = n, int(out["next_token"][0, -1])

    def decode(self) -> float:
        """One greedy decode step; returns its wall time in seconds."""
        import numpy as np

        x = np.array([[self.next]], np.int64)
        mask = np.ones((1, self.length + 1), np.int64)
        pos = np.array([[self.length]], np.int64)
        t0 = time.perf_counter()
        out = chain_step(self.streams, x, mask, pos)
        dt = time.perf_counter() - t0
        self.length += 1
        self.next = int(out["next_token"][0, -1])
        return dt


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from engine.models.demo import cache_root, ensure_recipe
    import openvino as ov

    from engine.shards.export import ensure_shard
    from engine.shards.runtime import ShardRunner, runtime_op_counts

    quick = bool(args.quick)
    layers = args.layers or (8 if quick else 16)
    tokens = args.tokens or (16 if quick else 32)
    repeats = args.repeats or (5 if quick else 9)
    if args.arch == "qwen3_moe":
        recipe = moe_recipe(args.hidden, layers, args.experts, args.top_k, args.expert_inter, args.heads,
                            args.kv_heads)
    else:
        recipe = dense_recipe(args.hidden, layers, args.inter, args.heads, args.kv_heads)
    report(f"building {recipe.demo_id} (first run only)")
    path = ensure_recipe(recipe)
    model = model_summary(path, recipe)
    report(f"model: {model['params_m']} M params, {model['f32_weights_mb']} MB f32")

    from engine.pipeline.runner import even_split

    ranges = list(even_split(layers, args.stages))

    def shard(start: int, end: int, fuse: bool):
        t = time.time()
        info = ensure_shard(path, start, end, num_layers_total=layers, fuse_beam_idx=fuse)
        if time.time() - t > 1:
            report(f"  exported [{start}, {end}) fuse_beam_idx={fuse} in {time.time() - t:.1f} s")
        return info

    wanted = [(0, layers, True)] + [(s, e, True) for s, e in ranges] + [(s, e, False) for s, e in ranges]
    if not quick:
        wanted.append((0, layers, False))
    infos = {(s, e, f): shard(s, e, f) for s, e, f in wanted}

    config: dict[str, Any] = {}
    if args.threads:
        config["INFERENCE_NUM_THREADS"] = int(args.threads)
    core = ov.Core()
    blobs = cache_root() / "ov-blobs"

    def runner(key):
        return ShardRunner(infos[key], exact=args.exact, cache_dir=blobs, core=core, config=config)

    chains = [Chain("whole", [runner((0, layers, True))]),
              Chain("split", [runner((s, e, True)) for s, e in ranges]),
              Chain("split_nofix", [runner((s, e, False)) for s, e in ranges])]
    if not quick:
        chains.append(Chain("whole_nofix", [runner((0, layers, False))]))

    fused = {c.name: [len(r.fused_sdpa_nodes()) for r in c.runners] for c in chains}
    want = {c.name: [r.info.end - r.info.start for r in c.runners] for c in chains}
    fused_all = fused["split"] == want["split"] and fused["whole"] == want["whole"]
    report(f"fused SDPA nodes per shard: {fused} (layers {want['split']})")

    import os

    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    vocab = model["vocab"]
    prompt = [int(t) for t in rng.integers(3, vocab, size=args.context)]
    per_rep: dict[str, list[float]] = {c.name: [] for c in chains}
    for rep in range(repeats):
        times: dict[str, list[float]] = {c.name: [] for c in chains}
        for c in chains:
            c.reset()
            c.prefill(prompt)
        for step in range(args.warmup + tokens):
            k = (rep + step) % len(chains)
            for c in chains[k:] + chains[:k]:  # rotate who goes first
                dt = c.decode()
                if step >= args.warmup:
                    times[c.name].append(dt)
        for name, ts in times.items():
            per_rep[name].append(statistics.median(ts) * 1e3)
        report(f"  repeat {rep + 1}/{repeats}: " + "  ".join(f"{n} {per_rep[n][-1]:.2f} ms" for n in per_rep))

    ms = {n: statistics.median(v) for n, v in per_rep.items()}
    ratio = [s / w for s, w in zip(per_rep["split"], per_rep["whole"])]
    ratio_nofix = [s / w for s, w in zip(per_rep["split_nofix"], per_rep["whole"])]
    ops_fused = runtime_op_counts(chains[1].runners[0].compiled)
    ops_nofix = runtime_op_counts(chains[2].runners[0].compiled)
    keep = ("ScaledDotProductAttention", "MemoryInput", "MemoryOutput", "Gather", "Concatenation",
            "MatMul", "FullyConnected", "Softmax")
    out: dict[str, Any] = {
        "model": model,
        "stages": args.stages, "ranges": [list(r) for r in ranges],
        "context_tokens": args.context, "timed_tokens_per_repeat": tokens, "warmup_tokens": args.warmup,
        "repeats": repeats, "threads": args.threads or "default", "exact_f32": bool(args.exact),
        "whole_ms": round(ms["whole"], 3),
        "split_ms": round(ms["split"], 3),
        "split_without_fix_ms": round(ms["split_nofix"], 3),
        "split_over_whole": round(ms["split"] / ms["whole"], 4),
        "split_over_whole_without_fix": round(ms["split_nofix"] / ms["whole"], 4),
        "split_over_whole_per_repeat": [round(r, 4) for r in ratio],
        "split_over_whole_without_fix_per_repeat": [round(r, 4) for r in ratio_nofix],
        "fused_sdpa_all_shards": bool(fused_all),
        "fused_sdpa_nodes": fused,
        "runtime_ops_first_shard": {"fused": {k: ops_fused.get(k, 0) for k in keep},
                                    "without_fix": {k: ops_nofix.get(k, 0) for k in keep}},
        "loadavg": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "goals": {"split_over_whole": 1.05},
    }
    if "whole_nofix" in ms:
        out["whole_without_fix_ms"] = round(ms["whole_nofix"], 3)
    del chains  # the memory runs are other processes; free this one's models first
    out["memory"] = memory_runs(path, layers, ranges, args, report)
    return out


def memory_runs(path, layers: int, ranges: list, args: argparse.Namespace,
                report: Callable[[str], None]) -> dict[str, Any]:
    """Each whole / split shard alone in its own process at each --memory-weights precision."""
    from engine.bench._shard_memory import planned, schedule, stage_memory
    from engine.shards.export import ensure_shard

    precisions = [w.strip() for w in str(args.memory_weights).split(",") if w.strip()]
    calls = schedule(args.memory_context, 512, args.memory_decode)
    out: dict[str, Any] = {"context_tokens": args.memory_context, "calls": len(calls),
                           "call_tokens": calls, "by_precision": {}}
    for prec in precisions:
        runs: dict[str, Any] = {}
        for name, rs in (("whole", [(0, layers)]), ("split", ranges)):
            runs[name] = []
            plans = planned(path, list(rs), prec, args.memory_context)
            for (s, e), plan in zip(rs, plans):
                info = ensure_shard(path, s, e, num_layers_total=layers, precision=prec)
                r = stage_memory(info, plan, calls)
                runs[name].append(r)
                report(f"  memory {prec} {name} [{s}, {e}): anon peak {r['measured']['anon_peak_bytes'] / 2**20:.0f} MiB"
                       f", planned {r['planned']['process_bytes'] / 2**20:.0f} MiB, shard "
                       f"{r['shard_bytes'] / 2**20:.0f} MiB")
        out["by_precision"][prec] = runs
    return out

"""Re-measure the planner's runtime reserve and KV bytes on this machine.

    python -m engine.bench._reserve [--hidden 1024 2048] [--precisions f32 fp16 int8 int4]
                                    [--kv-tokens 4096] [--exact]

For each model size and weight precision a middle shard (layers [2, 6) of an
8-layer random-weight Llama built from its config) is exported with
`ensure_shard`, then a FRESH python process imports OpenVINO, compiles it with
`ShardRunner` and runs one inference (a 16-token prefill + 1 decode step).
It prints RssAnon (/proc/PID/status: anonymous memory, what a cgroup cap and
the OOM killer count; mapped IR file pages are reclaimable and excluded) at
each step, and `RssAnon - shard bytes` = the runtime reserve the planner adds
to a stage (engine/planner/memory.py RUNTIME_RESERVE_*). Two sizes separate a
fixed part from one proportional to the weights (a least-squares line per
precision). With --kv-tokens, the stream then prefills in --chunk-token chunks
up to that many tokens: the RssAnon slope per token of context is KV + prefill
activations; two runs with different --kv-heads separate the two (compare with
kv_element_bytes, prefill_scratch). Figures are recorded in docs/planner.md.
Not a `flotilla bench` scenario (the leading underscore): a tool for
whoever tunes the planner constants, a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHUNK = 512  # prompt tokens per infer call in the sweep, like the coordinator's prefill_chunk


def rss() -> dict[str, int]:
    """RssAnon, RssFile, VmRSS, VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def child(shard: str, exact: bool, kv_tokens: int, chunk: int) -> dict:
    """Runs in the fresh process: compile, one inference, optional KV sweep."""
    import numpy as np

    from engine.shards.runtime import ShardRunner

    steps = {"python": rss()}
    import openvino  # noqa: F401

    steps["imported"] = rss()
    runner = ShardRunner(Path(shard), "CPU", exact=exact)
    steps["compiled"] = rss()
    info = runner.info
    kv = str(runner.compiled.get_property("KV_CACHE_PRECISION"))
    stream = runner.new_stream()
    rng = np.random.default_rng(0)

    def feed(past: int, n: int) -> dict:
        x = rng.standard_normal((1, n, info.hidden_size)).astype(np.float32)
        return {"hidden_states": x, "attention_mask": np.ones((1, past + n), np.int64),
                "position_ids": np.arange(past, past + n, dtype=np.int64)[None]}

    stream.run(feed(0, 16))
    stream.run(feed(16, 1))
    steps["inferred"] = rss()
    sweep = []
    if kv_tokens:
        stream.reset()
        past = 0
        while past < kv_tokens:
            stream.run(feed(past, chunk))
            past += chunk
            sweep.append((past, rss()["RssAnon"]))
        for _ in range(4):  # decode after the prompt: the single-token kernels
            stream.run(feed(past, 1))
            past += 1
        sweep.append((past, rss()["RssAnon"]))
    return {"steps": steps, "kv_cache_precision": kv, "kv_sweep": sweep}


def shard_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("shard.bin"))


def measure(model_path: Path, precision: str, exact: bool, kv_tokens: int, chunk: int = CHUNK) -> dict:
    from engine.shards.export import ensure_shard

    info = ensure_shard(model_path, 2, 6, num_layers_total=8, precision=precision)
    out = subprocess.run([sys.executable, "-m", "engine.bench._reserve", "--child", info.path,
                          "--kv-tokens", str(kv_tokens), "--chunk", str(chunk)] + (["--exact"] if exact else []),
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["shard_bytes"] = shard_bytes(Path(info.path))
    res["reserve"] = res["steps"]["inferred"]["RssAnon"] - res["shard_bytes"]
    res["kv"] = {"heads": info.num_kv_heads, "head_dim": info.head_dim, "layers": info.end - info.start}
    return res


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(fixed, fraction) of reserve = fixed + fraction * shard bytes."""
    if len(points) < 2:
        return float(points[0][1]), 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--precisions", nargs="+", default=["f32", "fp16", "int8", "int4"])
    p.add_argument("--kv-tokens", type=int, default=0, help="KV sweep length (0 = none)")
    p.add_argument("--exact", action="store_true", help="f32 inference + f32 KV (our 'exact' mode)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="prompt tokens per call in the sweep")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=16, help="K/V heads")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.exact, args.kv_tokens, args.chunk)))
        return 0

    from engine.bench.shards import dense_recipe
    from engine.models.demo import ensure_recipe

    table: dict[str, list] = {}
    for hidden in args.hidden:
        recipe = dense_recipe(hidden, 8, heads=args.heads, kv_heads=args.kv_heads)
        path = ensure_recipe(recipe)
        for prec in args.precisions:
            r = measure(path, prec, args.exact, args.kv_tokens, args.chunk)
            st = r["steps"]
            row = {"hidden": hidden, "heads": args.heads, "kv_heads": args.kv_heads, "chunk": args.chunk,
                   "exact": args.exact, "precision": prec, "shard_mb": r["shard_bytes"] / 1e6,
                   "anon_imported_mb": st["imported"]["RssAnon"] / 1e6,
                   "anon_compiled_mb": st["compiled"]["RssAnon"] / 1e6,
                   "anon_inferred_mb": st["inferred"]["RssAnon"] / 1e6,
                   "reserve_mb": r["reserve"] / 1e6, "kv_cache_precision": r["kv_cache_precision"]}
            if r["kv_sweep"]:
                (t0, a0), (t1, a1) = r["kv_sweep"][0], r["kv_sweep"][-1]
                el = 2 * r["kv"]["heads"] * r["kv"]["head_dim"] * r["kv"]["layers"]
                row["kv_bytes_per_element"] = (a1 - a0) / (t1 - t0) / el
                row["kv_sweep"] = r["kv_sweep"]
            table.setdefault(prec, []).append((r["shard_bytes"], r["reserve"]))
            print(json.dumps(row), flush=True)
    for prec, pts in table.items():
        fixed, frac = fit(pts)
        print(json.dumps({"precision": prec, "fixed_mb": round(fixed / 1e6, 1),
                          "fraction_of_shard": round(frac, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`flotilla bench sparse`: the sparse-FFN engine against its baselines, on a
random-weight Llama bigger than the memory it may use.

Shapes (`--shape`):
  llama-3.1-8b (default)  Llama-3.1-8B's published shapes -- hidden 4096, FFN 14336, GQA
      32/8, vocab 128256 -- with 12 layers (quick) or 16 (full), bf16, sharded safetensors
      (engine/bench/_checkpoint.py, built once outside the repository). Every engine run
      (ours, on-demand, the mmap baseline) is a child process in a cgroup-v1 memory group
      limited from its first byte to --cap-fraction (0.5) x the checkpoint bytes: the
      model is twice the memory. Ours picks its cache budget itself, as for a user (what
      the cap leaves after the resident weights, the KV reserve and working memory).
      Predicted mode by default: exact mode's resident gates alone are a third of the FFN.
  synthetic  8B-shaped layers on the demo vocabulary (2 layers quick, 4 full; --hidden etc.
      shrink it for tests), exact mode; each capped child may use its setup usage +
      16 MiB + half the FFN bytes (ours: gates + predictors + cache = that half).
  demo  a demo model as it ships (`--model`, default the trained `demo-relu`; `demo-relu-random`
      for its random-weight build), f32, exact mode, capped as synthetic: activation
      statistics of a trained model (locality, natural ReLU zeros) at a tiny size.

The mmap baseline: the same resident attention and head in the same dtype and kernels,
every FFN matrix (and the input embedding, as in ours) a view of the mmap'd checkpoint,
page cache dropped first, default readahead; bytes read from /proc/self/io. Also:
on-demand (same cap, no prefetch), all-resident sparse (cache holds every neuron) and
all-resident dense (same kernels; both uncapped), a disk probe of the store files, and a
clearly labelled scenario: the same engine fed a replayed active-set trace with a set
overlap. Quality beside speed at every threshold (`--sparsities`): teacher-forced top-1
agreement with dense and perplexity; the headline is at equal quality (agreement >= 0.9).
Repeats are interleaved (the machine's load drifts); figures are medians.
Random weights have little temporal locality: the measured overlap is reported
next to the speedups.

`io` records what our reads went through: {"requested", "effective",
"fallback_reason"} ("o_direct" or "buffered"), over the stores of ours and
on-demand. When O_DIRECT was requested but is not in effect (a file system
refusing it, a store on tmpfs), every speedup field is null and
`speedup_refused` says why.
"""

from __future__ import annotations

import statistics
import time

NAME = "sparse"
HELP = "sparse-FFN engine (delta prefetch) vs OS paging (mmap + cgroup cap), on-demand and all-resident"

EQUAL_QUALITY = 0.9  # top-1 agreement with dense at which the headline speedup is quoted
REPLAY_JACCARD = (0.5, 0.85)  # scenario only: the overlap trained models show is 0.82-0.85 (paper)
PROMPT = "Once upon a time there was a small robot who lived in a quiet town by the sea."
SHAPES = ("llama-3.1-8b", "synthetic", "demo")
REAL_LAYERS_QUICK, REAL_LAYERS_FULL = 12, 16  # llama-3.1-8b: decoder layers built (the checkpoint is 2x the cap)
CONTEXT = 1024  # KV reserved by the benchmark's engines (prompt + tokens fit many times over)


def add_arguments(parser) -> None:
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b",
                        help="llama-3.1-8b (default): the published model's shapes (vocab 128256, bf16, sharded "
                             "safetensors) with --layers layers, every engine run in a memory group capped at "
                             "--cap-fraction of the checkpoint; synthetic: 8B-shaped layers on the demo vocabulary "
                             "(--hidden etc. shrink it), capped at setup + half the FFN bytes; demo: a demo model "
                             "as it ships (--model), capped as synthetic")
    parser.add_argument("--model", default="demo-relu",
                        help="demo: which demo id (default demo-relu, trained; demo-relu-random: random weights)")
    parser.add_argument("--cap-fraction", type=float, default=0.5,
                        help="llama-3.1-8b: memory cap / checkpoint bytes (default 0.5: the model is 2x the cap)")
    parser.add_argument("--delete-after", action="store_true",
                        help="llama-3.1-8b: delete the checkpoint, its store and calibrations when done")
    parser.add_argument("--sparsity", type=float, default=0.8,
                        help="SwiGLU target sparsity of the on-demand, replay and all-resident runs (default 0.8)")
    parser.add_argument("--sparsities", default="0,0.5,0.8",
                        help="thresholds at which the engine's speed and quality (teacher-forced top-1 agreement "
                             "with dense, perplexity) are measured side by side (default 0,0.5,0.8; --sparsity "
                             "is added); the headline speedup is at the highest whose agreement >= 0.9")
    parser.add_argument("--mode", choices=("predicted", "exact"), default=None,
                        help="exact: gate resident, exact active set (default for synthetic); predicted: low-rank "
                             "predictor picks, nothing of the FFN resident (default for llama-3.1-8b, whose gates "
                             "alone would take 2/3 of the cap)")
    parser.add_argument("--tokens", type=int, default=None, help="decode tokens per run")
    parser.add_argument("--repeats", type=int, default=None, help="runs per variant (median reported)")
    parser.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16",
                        help="synthetic: weight dtype of the benchmark checkpoint, for ours and mmap alike "
                             "(default bf16; llama-3.1-8b is bf16 as shipped)")
    parser.add_argument("--prefetch-top", type=float, default=0.25,
                        help="read ahead only the most confident guesses: this share of the mean active count")
    parser.add_argument("--buffered", action="store_true", help="buffered reads instead of O_DIRECT")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"decoder layers (llama-3.1-8b: default {REAL_LAYERS_QUICK} quick, {REAL_LAYERS_FULL} "
                             "full; synthetic: 2 quick, 4 full)")
    parser.add_argument("--hidden", type=int, default=4096, help="synthetic: hidden size (default 4096)")
    parser.add_argument("--intermediate", type=int, default=14336, help="synthetic: FFN width (default 14336)")
    parser.add_argument("--heads", type=int, default=32, help="synthetic: attention heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="synthetic: K/V heads (default 8, GQA)")


def bench_recipe(quick: bool, layers: int | None = None, hidden: int = 4096, intermediate: int = 14336,
                 heads: int = 32, kv_heads: int = 8):
    from engine.models.demo import DemoRecipe

    layers = layers or (2 if quick else 4)
    shape = (hidden, intermediate, heads, kv_heads)
    name = (f"sparse-bench-h4096-{layers}l" if shape == (4096, 14336, 32, 8)  # the published model's name
            else f"sparse-bench-h{hidden}-i{intermediate}-a{heads}-kv{kv_heads}-{layers}l")
    return DemoRecipe(
        name, "LlamaConfig",
        dict(initializer_range=0.02, max_position_embeddings=4096, tie_word_embeddings=False,
             hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5),
        seed=11, description=(f"sparse bench: Llama-3-8B-shaped layers (hidden {hidden}, FFN {intermediate}), "
                              "random weights" if shape == (4096, 14336, 32, 8) else
                              f"sparse bench: small Llama (hidden {hidden}, FFN {intermediate}), random weights"),
        tokenizer_of="demo")


def with_dtype(path, dtype: str, report):
    """A copy of the model folder with the weights stored in `dtype` (bf16, f16; f32 = as built).
    Real checkpoints ship 16-bit weights; both the engine and the mmap baseline then read 16-bit."""
    import json
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    if dtype == "f32":
        return path
    out = path.with_name(f"{path.name}-{dtype}")
    if (out / "model.safetensors").exists():
        return out
    report(f"writing a {dtype} copy of the benchmark model (once)")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    for f in path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.to(tdt).contiguous() for k, v in load_file(path / "model.safetensors").items()},
              tmp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16"}[dtype]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class OverlapTrace:
    """A replayed activation trace with a chosen overlap (benchmark scenario only):
    each decode token's set per layer has the true set's size, and shares with the
    previous token's set the share that gives Jaccard J: |A & B| = 2J/(1+J) * k."""

    def __init__(self, jaccard: float, neurons: int, seed: int = 0) -> None:
        import numpy as np

        self.j, self.neurons = jaccard, neurons
        self.rng = np.random.default_rng(seed)
        self.prev: dict[int, object] = {}

    def __call__(self, layer: int, need):
        import numpy as np

        k = len(need)
        prev = self.prev.get(layer)
        if prev is None:
            out = need
        else:
            m = min(len(prev), k, int(round(2 * self.j / (1 + self.j) * k)))
            keep = self.rng.choice(prev, m, replace=False)
            rest = np.setdiff1d(np.arange(self.neurons), prev, assume_unique=True)
            out = np.sort(np.concatenate([keep, self.rng.choice(rest, k - m, replace=False)]))
        self.prev[layer] = out
        return out


def decode_run(backend, ids: list[int], n: int) -> dict:
    import numpy as np

    rt = backend.rt
    rt.cache.clear()  # cold: every run starts with an empty neuron cache
    stream = backend.new_stream()
    logits = stream.prefill(ids)
    io1, pf1 = rt.store.stats.snapshot(), rt.prefetcher.stats.snapshot()
    rt.stats.jaccard_sum[:] = 0
    rt.stats.jaccard_n = 0
    times, out = [], []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    io2, pf2 = rt.store.stats.snapshot(), rt.prefetcher.stats.snapshot()
    stream.close()
    total = sum(times)
    jn = max(rt.stats.jaccard_n, 1)
    d = {k: pf2[k] - pf1[k] for k in pf2}
    dio = {k: io2[k] - io1[k] for k in io2}
    needed = max(1, d["needed"])
    wait = d["wait_s"] + dio["submit_s"]  # waiting for completions + blocked in io_submit on a full queue
    return {"tok_s": n / total, "bytes_per_token": dio["bytes_read"] / n, "reads_per_token": dio["reads"] / n,
            "io_share": wait / total, "io_wait_ms": 1e3 * wait / n,
            "verify_ms": 1e3 * dio["verify_s"] / n, "token_ms": 1e3 * total / n,
            "hit_rate": 1 - (d["on_demand"] + d["prefetch_used"]) / needed,
            "on_demand_share": d["on_demand"] / needed,
            "prefetch_precision": d["prefetch_used"] / d["prefetched"] if d["prefetched"] else None,
            "needed_per_token": d["needed"] / n,
            "jaccard_runtime": float((rt.stats.jaccard_sum / jn).mean()), "tokens": out}


def _dense_run(model, ids: list[int], n: int) -> dict:
    from engine.runtime.torch_backend import TorchStream

    stream = TorchStream(model)
    logits = stream.prefill(ids)
    times, out = [], []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    return {"tok_s": n / sum(times), "tokens": out}


def _med(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def _disk(store_dir, bundle: int, report) -> dict:
    from engine.sparse.diskprobe import best_gap, probe

    report("probing the disk (O_DIRECT random reads at several sizes and queue depths)")
    files = sorted(store_dir.glob("layer-*.bin"))
    sizes = sorted({4096, bundle, 65536, 262144})
    try:
        res = probe(files, sizes=sizes, depths=(1, 16, 64, 256), budget_s=0.08, rounds=3)
    except OSError as e:  # a file system that refuses O_DIRECT: no probe (and no bound from it)
        report(f"disk probe skipped: {e}")
        return {"error": f"O_DIRECT probe failed: {e}", "bundle_bytes": bundle}
    at = {(r["size"], r["depth"]): r for r in res["random"]}
    res["bundle_bytes"] = bundle
    res["bundle_read_mb_s_best_depth"] = max(r["mb_s"] for r in res["random"] if r["size"] == bundle)
    res["bundle_read_mb_s_depth_1"] = at[(bundle, 1)]["mb_s"]
    res["best_gap_bundles"] = best_gap(res, bundle)
    return res


def real_spec(layers: int | None, quick: bool):
    """Llama-3.1-8B's published shapes (vocab 128256, bf16, sharded) with `layers` layers."""
    from engine.bench._checkpoint import LLAMA_3_1_8B

    n = layers or (REAL_LAYERS_QUICK if quick else REAL_LAYERS_FULL)
    return LLAMA_3_1_8B.scaled(name=f"{LLAMA_3_1_8B.name}-{n}l", num_layers=n)


def _model(args, quick: bool, report) -> dict:
    """The benchmark checkpoint and the memory rule its engine runs under."""
    from engine.models.demo import ensure_recipe

    if args.shape == "demo":
        from engine.models.demo import ensure_demo, is_demo_id

        if not is_demo_id(args.model):
            raise SystemExit(f"--model {args.model}: not a demo id")
        return {"path": ensure_demo(args.model, lambda m, f: report(m)), "dtype": "f32",
                "mode": args.mode or "exact", "limit": None, "checkpoint": None}
    if args.shape == "synthetic":
        recipe = bench_recipe(quick, args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
        path = with_dtype(ensure_recipe(recipe, lambda m, f: report(m)), args.dtype, report)
        return {"path": path, "dtype": args.dtype, "mode": args.mode or "exact", "limit": None, "checkpoint": None}
    from engine.bench._cgroup import require_v1
    from engine.bench._checkpoint import checkpoint_bytes, ensure_checkpoint

    require_v1()  # no cap, no figures: the real shape never runs uncapped
    spec = real_spec(args.layers, quick)
    path = ensure_checkpoint(spec, report=report)
    ckpt = checkpoint_bytes(path)
    return {"path": path, "dtype": "bf16", "mode": args.mode or "predicted", "checkpoint": path,
            "checkpoint_bytes": ckpt, "limit": int(ckpt * args.cap_fraction), "spec": spec.name}


def run(args, report) -> dict:
    import json
    import shutil

    import torch
    from transformers import AutoTokenizer

    from engine.bench.moe import io_figures, refuse_speedups, speedup_refusal
    from engine.sparse.baseline import cgroups_available, run_capped_child, run_mmap_baseline
    from engine.sparse.calibrate import ensure_calibration, summary, work_dir
    from engine.sparse.engine import SparseBackend, SparseConfig, calib_config, min_cache_bytes
    from engine.sparse.store import STORE_VERSION, BundleStore, StoreConfig, build_store
    from engine.sparse.weights import MappedWeights, ffn_bytes, ffn_layout, load_dense_mmap

    torch.set_grad_enabled(False)
    quick = bool(args.quick)
    n = args.tokens or (12 if quick else 32)
    repeats = args.repeats or 3
    report("building the benchmark model (once)")
    setup = _model(args, quick, report)
    path, mode, limit = setup["path"], setup["mode"], setup["limit"]
    layout = ffn_layout(path)
    itemsize = {"f32": 4, "f16": 2, "bf16": 2}[setup["dtype"]]
    ffn = ffn_bytes(layout, itemsize)
    cap = ffn // 2 if limit is None else limit  # synthetic: FFN-side bytes above setup; real: the whole group
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    direct = not args.buffered
    sparsities = sorted({float(x) for x in str(args.sparsities).split(",") if x.strip()} | {args.sparsity})
    report("building the neuron store and calibrating every threshold (once each)")
    store_dir = work_dir(path) / f"store-{'exact' if mode == 'exact' else 'full'}-v{STORE_VERSION}"
    if not (store_dir / "meta.json").exists():
        build_store(MappedWeights(path), layout, store_dir, "exact" if mode == "exact" else "full",
                    lambda m, f: report(m))
    store = BundleStore(store_dir, StoreConfig(direct=direct))
    bundle, row_bytes, ours_probe_info = store.stride, store.cache_slot_bytes, store.io_info()
    store.close()
    gates_bytes = layout.num_layers * layout.neurons * layout.hidden * itemsize if mode == "exact" else 0
    per_s: dict[float, dict] = {}
    for sp in sparsities:
        calib = ensure_calibration(path, calib_config(SparseConfig(mode=mode, sparsity=sp)), lambda m, f: report(m))
        if mode == "exact":
            calib.own = [None] * layout.num_layers  # exact mode: the own predictors are not used
        per_s[sp] = {"fixed": calib.predictor_bytes() + gates_bytes, "calib": calib, "skipped": None,
                     "min_budget": min_cache_bytes(calib, mode, row_bytes)}
    if args.shape == "demo":  # tiny: gates + predictors are most of the FFN; the cache gets half the FFN above them
        cap = ffn // 2 + max(v["fixed"] for v in per_s.values())
    for sp in sparsities:
        if limit is None and cap - per_s[sp]["fixed"] < per_s[sp]["min_budget"]:  # its quality is still measured
            per_s[sp]["skipped"] = (f"one layer's active set ({per_s[sp]['min_budget']} bytes) does not fit what "
                                    f"the cap leaves for the cache ({cap - per_s[sp]['fixed']} bytes)")
            report(f"sparsity {sp}: no speed run: {per_s[sp]['skipped']}")
    if per_s[args.sparsity]["skipped"]:
        raise SystemExit(f"--sparsity {args.sparsity}: {per_s[args.sparsity]['skipped']}")
    calib = summary(per_s[args.sparsity]["calib"])
    fixed, min_budget = per_s[args.sparsity]["fixed"], per_s[args.sparsity]["min_budget"]
    disk = _disk(store_dir, bundle, report)
    store_cfg = StoreConfig(max_gap=min(disk.get("best_gap_bundles", 0), 8), direct=direct)
    base = SparseConfig(mode=mode, sparsity=args.sparsity, store=store_cfg, prefetch_top=args.prefetch_top,
                        context_length=CONTEXT)
    can_cgroup = cgroups_available()
    report("quality at every threshold: teacher-forced top-1 agreement with dense and perplexity")
    from engine.sparse.quality import evaluate

    quality = {float(r["sparsity"]): r for r in evaluate(path, {str(sp): per_s[sp]["calib"] for sp in sparsities},
                                                          modes=(mode,))}

    def capped_run(sp: float, prefetch: str | None = None) -> dict:
        """One decode run of the engine at threshold sp, in a capped child where cgroups exist.
        Synthetic: the budget is what the cap leaves above the common setup (the mmap baseline's
        allowance); real shape: the engine picks its budget under the absolute limit."""
        cfg = {**base.__dict__, "sparsity": sp,
               "cache_budget_bytes": None if limit is not None else cap - per_s[sp]["fixed"]}
        if prefetch:
            cfg["prefetch"] = prefetch
        if not can_cgroup:
            be = SparseBackend(path, SparseConfig(**cfg), context_length=CONTEXT)
            try:
                return decode_run(be, ids, n) | {"cache_budget_bytes": be.rt.cache.budget_bytes}
            finally:
                be.close()
        cell = {"path": str(path), "ids": ids, "tokens": n,
                "config": {k: v for k, v in cfg.items() if k not in ("memory", "store", "text")}
                | {"store": {"max_gap": store_cfg.max_gap, "direct": direct}}}
        return run_capped_child(["engine.bench._sparse_cell", json.dumps(cell)], cap, limit_bytes=limit,
                                what=f"sparse engine (s={sp}{', ' + prefetch if prefetch else ''})")

    runs: dict[str, list[dict]] = {"ours": [], "on_demand": [], "mmap": []}
    by_s: dict[float, list[dict]] = {sp: [] for sp in sparsities}
    ours_infos: list[dict] = []
    replay = None  # in-process engine for the labelled scenario, with the cache ours had
    for r in range(repeats):  # interleaved: the machine's load drifts, every variant sees the same drift
        for sp in sparsities:
            if per_s[sp]["skipped"]:
                continue
            report(f"repeat {r + 1}/{repeats}: ours at sparsity {sp}" + (" (capped child)" if can_cgroup else ""))
            m = capped_run(sp)
            if "error" in m:  # the engine refused: no budget fits under the cap at this threshold
                per_s[sp]["skipped"] = m["error"]
                report(f"sparsity {sp}: no speed run: {m['error']}")
                if sp == args.sparsity:
                    raise SystemExit(f"--sparsity {sp}: {m['error']}")
                continue
            ours_infos.append(m.pop("io_info", None) or ours_probe_info)
            by_s[sp].append(m)
        runs["ours"].append(by_s[args.sparsity][-1])
        report(f"repeat {r + 1}/{repeats}: on-demand (same cap, no prefetch)")
        m = capped_run(args.sparsity, prefetch="none")
        ours_infos.append(m.pop("io_info", None) or ours_probe_info)
        runs["on_demand"].append(m)
        if replay is None:
            replay = SparseBackend(path, SparseConfig(**{**base.__dict__, "prefetch": "none",
                                                         "cache_budget_bytes": m["cache_budget_bytes"]}),
                                   context_length=CONTEXT)
        for j in REPLAY_JACCARD:  # labelled scenario: the same I/O path on a replayed trace with overlap j
            report(f"repeat {r + 1}/{repeats}: scenario, replayed trace with Jaccard {j}")
            replay.rt.trace = OverlapTrace(j, layout.neurons, seed=r)
            runs.setdefault(f"replay_{j}", []).append(decode_run(replay, ids, n))
            replay.rt.trace = None
        if can_cgroup:
            report(f"repeat {r + 1}/{repeats}: dense through mmap under a cgroup cap")
            m = run_mmap_baseline(path, ids, n, cap, limit_bytes=limit)
            m["tok_s"] = n / sum(m["decode_s"])
            m["bytes_per_token"] = m["decode_read_bytes"] / n
            m["read_mb_s"] = m["decode_read_bytes"] / sum(m["decode_s"]) / 1e6
            runs["mmap"].append(m)
    io = io_figures(direct, ours_infos + [replay.rt.store.io_info()])
    report(f"reads: {io['effective']}" + (f" (O_DIRECT not in effect: {io['fallback_reason']})"
                                          if io["fallback_reason"] else ""))
    non_ffn = replay.resident_bytes
    replay.close()
    report("all-resident sparse and dense (no cap)")
    allres = SparseBackend(path, SparseConfig(**{**base.__dict__, "cache_budget_bytes": 2 * ffn, "warm": True}),
                           context_length=CONTEXT)
    res_sparse = [_decode_run_warm(allres, ids, n) for _ in range(repeats)]
    allres.close()
    dense = load_dense_mmap(path, resident=True)
    res_dense = [_dense_run(dense, ids, n) for _ in range(repeats)]
    del dense
    budget = int(_med(runs["ours"], "cache_budget_bytes"))
    out = _figures(args, layout, setup, ffn, non_ffn, cap, budget, fixed, min_budget, bundle, row_bytes,
                   store_cfg, io, n, repeats, runs, by_s, per_s, res_sparse, res_dense, calib, disk, quality,
                   sparsities, can_cgroup)
    refusal = speedup_refusal(io)
    if refusal:
        refuse_speedups(out, refusal)
        out["goal_met"] = None  # not measured: the speedup was refused
        report(f"speedups refused: {refusal}")
    if setup["checkpoint"] is not None and args.delete_after:
        for folder in (work_dir(path), setup["checkpoint"]):
            shutil.rmtree(folder, ignore_errors=True)
        report("deleted the checkpoint, its neuron store and calibrations (--delete-after)")
    return out


def _independent_jaccard(calib: dict) -> float:
    """Jaccard of two independent random sets of the measured density d: d / (2 - d)
    (the measured sparsity: ReLU models have their own, not the --sparsity target)."""
    d = 1 - (calib["sparsity_measured"] if calib["sparsity_measured"] is not None else calib["sparsity_target"])
    return round(d / (2 - d), 4)


def _overlap_note(args, calib: dict) -> str:
    """What the measured overlap means for this run's model."""
    overlap = (f"consecutive tokens' active sets overlap with Jaccard {calib['jaccard_mean']} (independent "
               f"sets of the same density: {_independent_jaccard(calib)}; the paper's "
               "trained models: 0.82-0.85)")
    if args.shape == "demo":
        return f"demo model {args.model} as it ships: {overlap}"
    return (f"random weights have little temporal locality: {overlap}, so the neuron cache and the predictors "
            "help little here; the speedup comes from reading only active neurons in big batched O_DIRECT reads")


def _figures(args, layout, setup, ffn, non_ffn, cap, budget, fixed, min_budget, bundle, row_bytes, store_cfg, io,
             n, repeats, runs, by_s, per_s, res_sparse, res_dense, calib, disk, quality, sparsities,
             can_cgroup) -> dict:
    """The JSON of one run, from the measurements."""
    med = {k: {f: _med(v, f) for f in ("tok_s", "bytes_per_token")} for k, v in runs.items() if v}
    o = {f: _med(runs["ours"], f) for f in ("token_ms", "io_wait_ms", "verify_ms", "reads_per_token",
                                             "needed_per_token", "prefetch_precision")}
    floor_ms = 1e3 / _med(res_sparse, "tok_s")
    mm = runs["mmap"]
    limit = setup["limit"]
    out = {
        "model": {"path": str(setup["path"]), "shape": args.shape,
                  "demo_id": args.model if args.shape == "demo" else None, "layers": layout.num_layers,
                  "hidden": layout.hidden, "neurons": layout.neurons, "dtype": setup["dtype"], "ffn_bytes": ffn,
                  "non_ffn_resident_bytes": non_ffn, "checkpoint_bytes": setup.get("checkpoint_bytes")},
        "cap_rule": ("above_setup: each capped child may use its own setup usage + 16 MiB + cap_bytes "
                     + ("(cap_bytes = 50 % of the FFN bytes + ours' gates and predictors)" if args.shape == "demo"
                        else "(cap_bytes = 50 % of the FFN bytes)") if limit is None else
                     f"absolute: every capped child (ours, on-demand, mmap) runs in a memory group limited to "
                     f"cap_bytes = {args.cap_fraction} x the checkpoint from its first byte; ours picks its own "
                     "cache budget under it"),
        "cap_bytes": cap, "checkpoint_over_cap": round(setup["checkpoint_bytes"] / limit, 2) if limit else None,
        "context_length": CONTEXT, "cache_budget_bytes": budget, "min_cache_budget_bytes": min_budget,
        "fixed_ffn_side_bytes": fixed,
        "bundle_bytes_on_disk": bundle, "bundle_bytes_in_ram": row_bytes, "max_gap_bundles": store_cfg.max_gap,
        "io": io,
        "mode": setup["mode"], "sparsity": args.sparsity, "prefetch_top": args.prefetch_top,
        "decode_tokens": n, "repeats": repeats,
        "tok_s": {"ours": med["ours"]["tok_s"], "on_demand": med["on_demand"]["tok_s"],
                  "mmap": med["mmap"]["tok_s"] if mm else None,
                  "all_resident_sparse": _med(res_sparse, "tok_s"), "all_resident_dense": _med(res_dense, "tok_s")},
        "bytes_read_per_token": {"ours": med["ours"]["bytes_per_token"],
                                 "on_demand": med["on_demand"]["bytes_per_token"],
                                 "mmap": med["mmap"]["bytes_per_token"] if mm else None},
        "reads_per_token_ours": o["reads_per_token"],
        "mmap_read_mb_s": _med(mm, "read_mb_s") if mm else None,
        "io_share_of_latency": {"ours": _med(runs["ours"], "io_share"),
                                "on_demand": _med(runs["on_demand"], "io_share")},
        "time_per_token_ms_ours": {"total": o["token_ms"], "io_wait": o["io_wait_ms"], "crc_verify": o["verify_ms"],
                                   "all_resident_sparse_floor": round(floor_ms, 2),
                                   "other_compute_and_python": round(o["token_ms"] - o["io_wait_ms"]
                                                                     - o["verify_ms"], 2)},
        "cache_hit_rate": {"ours": _med(runs["ours"], "hit_rate"), "on_demand": _med(runs["on_demand"], "hit_rate")},
        "on_demand_share_ours": _med(runs["ours"], "on_demand_share"),
        "prefetch_precision_runtime": o["prefetch_precision"],
        "active_neurons_per_token": o["needed_per_token"],
        "predictor": {k: calib[k] for k in ("own_recall", "own_precision", "ahead_recall", "ahead_precision",
                                            "temporal_recall", "temporal_precision")},
        "overlap_jaccard": {"calibration_text_mean": calib["jaccard_mean"],
                            "per_layer": calib["jaccard_per_layer"],
                            "decode_runtime_mean": _med(runs["ours"], "jaccard_runtime"),
                            "sparsity_measured": calib["sparsity_measured"],
                            "independent_sets_same_density": _independent_jaccard(calib),
                            "paper_trained_models": "0.82-0.85"},
        "disk": disk,
        "same_tokens_ours_vs_on_demand": runs["ours"][0]["tokens"] == runs["on_demand"][0]["tokens"],
        "mmap_cgroup": ({k: mm[0][k] for k in ("cgroup_limit_bytes", "setup_usage_bytes", "max_usage_bytes")}
                        if mm else "cgroup v1 memory controller not writable: baseline skipped"),
        "ours_cgroup": ({k: max(m.get(k) or 0 for m in runs["ours"]) for k in
                         ("cgroup_limit_bytes", "setup_usage_bytes", "max_usage_bytes", "oom_kills")}
                        if can_cgroup else None),
        "note": _overlap_note(args, calib),
    }
    out["scenario_replayed_trace"] = {
        "label": ("SCENARIO, not the model's own activations: the same engine, cache budget and I/O path "
                  "(no prefetch, on-demand reads of the delta; in the bench's own process, not capped) fed a "
                  "replayed active-set trace whose consecutive-token overlap is set to Jaccard J (set sizes = "
                  "the true ones). Tokens are not the model's. Shows what the measured I/O path gives at the "
                  "locality trained models have; speedup_vs_mmap above is the real end-to-end measurement."),
        "runs": {str(j): {"jaccard_measured": _med(runs[f"replay_{j}"], "jaccard_runtime"),
                          "tok_s": _med(runs[f"replay_{j}"], "tok_s"),
                          "bytes_read_per_token": _med(runs[f"replay_{j}"], "bytes_per_token"),
                          "io_wait_ms": _med(runs[f"replay_{j}"], "io_wait_ms"),
                          "speedup_vs_mmap": (round(_med(runs[f"replay_{j}"], "tok_s") / out["tok_s"]["mmap"], 2)
                                              if mm else None)}
                 for j in REPLAY_JACCARD}}
    if mm and disk.get("random"):  # what bounds the speedup on this machine, from the measurements above
        probe = max(r["mb_s"] for r in disk["random"] if r["size"] == bundle)  # best queue depth
        # What our reads really reached (bytes over the time spent waiting for them): reads coalesce
        # neighbouring bundles into bigger requests than the probe's, so the probe can undercount.
        achieved = max((_med(runs[k], "bytes_per_token") / (_med(runs[k], "io_wait_ms") / 1e3) / 1e6
                        for k in ("ours", "on_demand") if (_med(runs[k], "io_wait_ms") or 0) > 0), default=0.0)
        bw = max(probe, achieved)
        io_lb = out["bytes_read_per_token"]["ours"] / bw / 1e3  # ms: our bytes at the best rate seen
        mmap_ms = 1e3 / out["tok_s"]["mmap"]
        out["bound"] = {
            "disk_mb_s_probe": probe, "disk_mb_s_achieved": round(achieved, 1), "disk_mb_s_used": round(bw, 1),
            "mmap_ms_per_token": round(mmap_ms, 1),
            "ours_ms_per_token": round(1e3 / out["tok_s"]["ours"], 1),
            "ours_io_lower_bound_ms": round(io_lb, 1),
            "ours_compute_floor_ms": round(floor_ms, 1),
            "max_speedup_if_io_fully_hidden": round(mmap_ms / max(io_lb, floor_ms), 2),
            "max_speedup_if_io_not_hidden": round(mmap_ms / (io_lb + floor_ms), 2),
            "explain": ("ours cannot beat max(its bytes at the best read rate seen -- the probe's for one "
                        "bundle, or what its own coalesced reads reached --, its all-resident compute); mmap "
                        "streams the dense FFN nearly sequentially (readahead) and pays its dense compute"),
        }
    t = out["tok_s"]
    out["speedup_vs_mmap"] = round(t["ours"] / t["mmap"], 2) if t["mmap"] else None
    # Speed and quality side by side at every threshold; the headline is at equal quality.
    rows = []
    for sp in sparsities:
        q, tok_s = quality[sp], _med(by_s[sp], "tok_s")
        rows.append({"sparsity": sp, "top1_agreement": q["top1_agreement"], "ppl_dense": q["ppl_dense"],
                     "ppl_sparse": q["ppl_sparse"], "ppl_change_pct": q["ppl_change_pct"], "tok_s": tok_s,
                     "bytes_per_token": _med(by_s[sp], "bytes_per_token"),
                     "cache_budget_bytes": _med(by_s[sp], "cache_budget_bytes"), "skipped": per_s[sp]["skipped"],
                     "max_usage_bytes": max([m.get("max_usage_bytes") or 0 for m in by_s[sp]] + [0]) or None,
                     "speedup_vs_mmap": round(tok_s / t["mmap"], 2) if t["mmap"] and tok_s else None})
    out["thresholds"] = rows
    out["ours_capped"] = can_cgroup  # ours ran in a capped child (the same rule as the mmap baseline)
    out["top1_agreement_at_sparsity"] = quality[args.sparsity]["top1_agreement"]
    good = [r for r in rows if r["top1_agreement"] >= EQUAL_QUALITY and r["tok_s"]]
    if good:
        best = max(good, key=lambda r: r["sparsity"])
        out["equal_quality"] = {"min_top1_agreement": EQUAL_QUALITY, "sparsity": best["sparsity"],
                                "top1_agreement": best["top1_agreement"], "ppl_change_pct": best["ppl_change_pct"],
                                "tok_s": best["tok_s"], "speedup_vs_mmap": best["speedup_vs_mmap"]}
    else:
        out["equal_quality"] = {"min_top1_agreement": EQUAL_QUALITY, "sparsity": None, "speedup_vs_mmap": None,
                                "reason": f"no threshold with a speed run reached {EQUAL_QUALITY} top-1 agreement "
                                          "with dense (agreements: " + ", ".join(
                                              f"{r['sparsity']}: {r['top1_agreement']}" for r in rows) + ")"}
    out["speedup_vs_on_demand"] = round(t["ours"] / t["on_demand"], 2)
    out["goal_speedup_vs_mmap"] = 8.0
    out["goal_met"] = bool(out["speedup_vs_mmap"] and out["speedup_vs_mmap"] >= 8.0)
    return out


def _decode_run_warm(backend, ids, n):
    """All-resident: the cache already holds every neuron; nothing is read."""
    import numpy as np

    stream = backend.new_stream()
    logits = stream.prefill(ids)
    times = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    stream.close()
    return {"tok_s": n / sum(times)}

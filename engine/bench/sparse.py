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

from engine.bench._sparse_model import REAL_LAYERS_FULL, REAL_LAYERS_QUICK, bench_model
from engine.bench._sparse_result import median_of, run_figures
from engine.bench._sparse_runs import (
    CONTEXT, REPLAY_JACCARD, OverlapTrace, decode_run, decode_run_warm, dense_run, disk_probe,
)

NAME = "sparse"
HELP = "sparse-FFN engine (delta prefetch) vs OS paging (mmap + cgroup cap), on-demand and all-resident"

PROMPT = "Once upon a time there was a small robot who lived in a quiet town by the sea."
SHAPES = ("llama-3.1-8b", "synthetic", "demo")


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


def run(args, report) -> dict:
    import json
    import shutil

    import torch
    from transformers import AutoTokenizer

    from engine.bench._io_figures import io_figures, refuse_speedups, speedup_refusal
    from engine.sparse.baseline import cgroups_available, run_capped_child, run_mmap_baseline
    from engine.sparse.calibrate import ensure_calibration, summary, work_dir
    from engine.runtime.torch_kv import KV_DTYPES
    from engine.sparse.engine import SparseBackend, SparseConfig, calib_config, min_cache_bytes
    from engine.sparse.store import STORE_VERSION, BundleStore, StoreConfig, build_store
    from engine.sparse.weights import MappedWeights, ffn_bytes, ffn_layout, load_dense_mmap

    torch.set_grad_enabled(False)
    quick = bool(args.quick)
    n = args.tokens or (12 if quick else 32)
    repeats = args.repeats or 3
    report("building the benchmark model (once)")
    setup = bench_model(args, quick, report)
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
    disk = disk_probe(store_dir, bundle, report)
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
            m = run_mmap_baseline(path, ids, n, cap, limit_bytes=limit, kv_precision=base.kv_precision)
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
    res_sparse = [decode_run_warm(allres, ids, n) for _ in range(repeats)]
    allres.close()
    dense = load_dense_mmap(path, resident=True)
    res_dense = [dense_run(dense, ids, n, KV_DTYPES[base.kv_precision]) for _ in range(repeats)]
    del dense
    budget = int(median_of(runs["ours"], "cache_budget_bytes"))
    out = run_figures(args, layout, setup, ffn, non_ffn, cap, budget, fixed, min_budget, bundle, row_bytes,
                      store_cfg, io, n, repeats, runs, by_s, per_s, res_sparse, res_dense, calib, disk, quality,
                      sparsities, can_cgroup)
    out["kv_precision"] = base.kv_precision  # the engine's, the mmap baseline's and all-resident dense's KV
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

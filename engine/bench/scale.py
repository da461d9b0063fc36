"""`flotilla bench scale`: a model of real size exported and run with every process under a
cgroup-v1 memory cap smaller than what it works on.

    flotilla bench scale --json FILE [--quick] [--precisions int4,int8,fp16]

1. Checkpoint (engine/bench/_checkpoint.py): random weights with the layer shapes of
   Llama-3.1-8B (16.1 GB bf16; --quick: Llama-3.2-1B, 2.5 GB), several bf16 safetensors files
   + index + config + tokenizer, built once into the cache (deterministic).
2. Reference (engine/bench/_reference.py): transformers, one decoder layer at a time, greedy
   next token at each of --positions (256) teacher-forced positions of a corpus text; cached.
3. For each precision, with even 2-stage ranges:
   export   each stage exported by engine.shards.export.ensure_shard in a fresh process
            inside a memory group capped at --export-cap x the bf16 checkpoint (default 0.6);
   forward  each stage run over the 256 positions (one process per stage, capped at
            --worker-cap x the whole model at that precision): teacher-forced top-1 agreement
            with the reference;
   fleet    two agents, each in its own memory group (engine/bench/_capped_fleet.py) capped at
            max(--worker-cap x the whole model at that precision, the plan's total_bytes for
            its stage), launched through the fleet launcher; a warm-up, then 1 and 2 streams
            of --tokens (64) tokens each (ignore_eos): tok/s, time to first token, every
            worker's peak RSS and anonymous peak next to its planned memory.
   The shards, bundles and agents' copies are deleted before the next precision (disk).
"whole model at that precision" = the sum of the stages' shard files.

passed = every capped process finished without an OOM kill, every cap was below what it
caps (the checkpoint for the exporter, the whole model for a worker), every stream produced
its tokens, the reference is finite and non-degenerate, and agreement is reported for every
precision (its value is not judged: int4 of random weights agrees less, by nature).
Memory figures: cgroup max_usage counts page cache (reclaimable; it reaches the cap whenever
a process streams files), VmHWM is the kernel's peak RSS, RssAnon peaks are sampled (0.1 s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

NAME = "scale"
HELP = ("models bigger than one PC: an 8B-shape bf16 checkpoint exported and run as 2 stages, every "
        "process under a cgroup memory cap below what it holds")

PRECISIONS = ("int4", "int8", "fp16")
DEFAULT_EXPORT_CAP = 0.6  # x the bf16 checkpoint
DEFAULT_WORKER_CAP = 0.75  # x the whole model at the run's precision
# Shard files per checkpoint byte (bf16), roughly, to check the disk before a precision starts.
SHARD_BYTES_PER_CHECKPOINT_BYTE = {"f32": 2.0, "bf16": 1.0, "fp16": 1.0, "int8": 0.5, "int4": 0.32}
DISK_FACTOR = 2.2  # the controller's shards + the agents' copies (bundles are sent from the folders), + 10 %
DISK_SLACK = 1 << 30
MIN_DISTINCT_ARGMAX = 8  # a reference with fewer different greedy tokens over 256 positions is degenerate
SHAPE_KEYS = {"hidden": "hidden_size", "intermediate": "intermediate_size", "layers": "num_layers",
              "heads": "num_heads", "kv_heads": "num_kv_heads", "vocab": "vocab_size",
              "tied": "tie_word_embeddings", "std": "init_std", "file_mb": "max_file_bytes"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help=f"shard weight precisions, comma-separated (default {','.join(PRECISIONS)})")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per stream (default 64)")
    p.add_argument("--positions", type=int, default=256, help="teacher-forced positions (default 256)")
    p.add_argument("--streams", default="1,2", help="stream counts (default 1,2)")
    p.add_argument("--context", type=int, default=1024, help="context length the plan reserves KV for "
                                                             "(default 1024)")
    p.add_argument("--export-cap", type=float, default=DEFAULT_EXPORT_CAP,
                   help=f"exporter cap as a fraction of the bf16 checkpoint (default {DEFAULT_EXPORT_CAP})")
    p.add_argument("--worker-cap", type=float, default=DEFAULT_WORKER_CAP,
                   help="agent+worker cap as a fraction of the whole model at that precision "
                        f"(default {DEFAULT_WORKER_CAP}; never below the plan's stage memory + the agent's own)")
    p.add_argument("--shape", default=None,
                   help="other shapes, e.g. hidden=1024,intermediate=2816,layers=8,heads=16,kv_heads=4,"
                        "vocab=32000,tied=0,file_mb=100 (experiments and tests)")
    p.add_argument("--exact", action="store_true", help="f32 inference and KV cache in every shard process")


def spec_for(quick: bool, shape: str | None = None):
    """The checkpoint spec of a run: 8B (1B with --quick) shapes, optionally overridden."""
    from engine.bench._checkpoint import LLAMA_3_1_8B, LLAMA_3_2_1B

    spec = LLAMA_3_2_1B if quick else LLAMA_3_1_8B
    if not shape:
        return spec
    changes: dict[str, Any] = {}
    for item in shape.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in SHAPE_KEYS or not value:
            raise SystemExit(f"--shape: unknown or empty {key!r}; known: {', '.join(SHAPE_KEYS)}")
        field = SHAPE_KEYS[key]
        changes[field] = (bool(int(value)) if field == "tie_word_embeddings" else float(value)
                          if field == "init_std" else int(float(value) * 1e6) if field == "max_file_bytes"
                          else int(value))
    return spec.scaled(name=f"{spec.name}-scaled", **changes)


def teacher_forced_ids(model_path: Path, n: int) -> list[int]:
    """n token ids of the demo corpus (the same text every run)."""
    from transformers import AutoTokenizer

    from engine.models.demo import CORPUS_PATH

    tok = AutoTokenizer.from_pretrained(str(model_path))
    ids = tok(CORPUS_PATH.read_text(encoding="utf-8"))["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return [int(t) for t in ids[:n]]


def drop_cached_shards(cache: Path, fingerprint: str, precision: str | None = None) -> int:
    """Remove cached shards of this checkpoint (a fresh export is what is measured)."""
    n = 0
    for manifest in Path(cache).glob("*/shard.json"):
        try:
            m = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if m.get("model_fingerprint") == fingerprint and precision in (None, m.get("precision")):
            shutil.rmtree(manifest.parent, ignore_errors=True)
            n += 1
    return n


def agreement(a: Sequence[int], b: Sequence[int]) -> dict[str, Any]:
    n = min(len(a), len(b))
    same = sum(1 for x, y in zip(a[:n], b[:n]) if x == y)
    return {"positions": n, "matches": same, "top1_agreement": round(same / n, 4) if n else None}


@dataclass(frozen=True)
class Caps:
    """The memory caps of a run (see the module docstring)."""

    export_fraction: float  # exporter: x the bf16 checkpoint
    worker_fraction: float  # agent + worker and teacher-forced stage: x the whole model at the precision
    worker_at_least_plan: bool = True  # an agent's cap is never below its stage's planned memory + the agent's own
    export_base_bytes: int = 0  # + what an exporter process holds with no model (tests of small models)
    forward_base_bytes: int = 0  # + what a teacher-forced stage process holds with no model
    worker_base_bytes: int = 0  # + what an agent and its worker hold with no model


def measure_precision(model_path: Path, precision: str, caps: Caps, *, ckpt_bytes: int,
                      ranges: Sequence[tuple[int, int]], layers: int, ids: Sequence[int], reference: Sequence[int],
                      context_length: int, streams: Sequence[int], tokens: int, exact: bool,
                      work: Path, report: Callable[[str], None]) -> dict[str, Any]:
    """Export, teacher-force and run one precision under caps; its JSON block."""
    import numpy as np

    from engine.bench._capped_fleet import CapRule, run_capped_fleet
    from engine.bench._capped_steps import run_capped
    from engine.shards.export import shard_cache_root

    from engine.models.fingerprint import model_fingerprint
    cache = shard_cache_root()
    fingerprint = model_fingerprint(model_path)
    drop_cached_shards(cache, fingerprint, precision)
    export_cap = caps.export_base_bytes + int(caps.export_fraction * ckpt_bytes)
    out: dict[str, Any] = {"ranges": [list(r) for r in ranges], "error": None,
                           "export": {"cap_bytes": export_cap, "cap_base_bytes": caps.export_base_bytes,
                                      "stages": []}}
    # Disk at the worst moment: the shards twice over (shard + bundle, bundle + an agent's copy, ...).
    need = int(DISK_FACTOR * SHARD_BYTES_PER_CHECKPOINT_BYTE.get(precision, 2.0) * ckpt_bytes) + DISK_SLACK
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < need:
        out["error"] = (f"disk_full: {precision} shards need about {need / 1e9:.1f} GB free in {cache}, "
                        f"{free / 1e9:.1f} GB are")
        report(f"{precision}: {out['error']}")
        return out
    paths = []
    for s, e in ranges:
        report(f"{precision}: exporting layers {s}-{e} under a {export_cap / 1e9:.2f} GB cap")
        rec = run_capped(f"export-{precision}-{s}", export_cap,
                         ["export", "--model", model_path, "--start", s, "--end", e, "--layers", layers,
                          "--precision", precision, "--cache", cache], work / f"export-{precision}-{s}.log")
        ans = rec.pop("answer", {})
        rec.update({"range": [s, e], "shard_bytes": ans.get("shard_bytes"), "export_s": ans.get("export_s")})
        out["export"]["stages"].append(rec)
        report(f"  {'ok' if rec['ok'] else rec['error']}: {rec['seconds']} s, VmHWM "
               f"{rec['vm_hwm_bytes'] / 1e9:.2f} GB, RssAnon peak {(rec['rss_anon_peak_bytes'] or 0) / 1e9:.2f} GB")
        if not rec["ok"]:
            drop_cached_shards(cache, fingerprint, precision)
            return out
        paths.append(Path(ans["path"]))
    shard_bytes = [r["shard_bytes"] for r in out["export"]["stages"]]
    whole = sum(shard_bytes)
    out.update({"shard_bytes": shard_bytes, "model_bytes": whole})
    try:
        # Teacher forcing: stage by stage, one shard in memory at a time.
        cap = caps.forward_base_bytes + int(caps.worker_fraction * whole)
        x = work / f"tf-{precision}-in.npy"
        np.save(x, np.array([list(ids)], np.int64))  # [1, n]
        out["teacher_forced"] = {"cap_bytes": cap, "cap_base_bytes": caps.forward_base_bytes, "stages": []}
        for i, path in enumerate(paths):
            y = work / f"tf-{precision}-{i}.npy"
            report(f"{precision}: teacher-forced stage {i} over {len(ids)} positions under {cap / 1e9:.2f} GB")
            rec = run_capped(f"forward-{precision}-{i}", cap,
                             ["forward", "--shard", path, "--input", x, "--output", y, *(["--exact"] if exact else [])],
                             work / f"forward-{precision}-{i}.log")
            rec.update(rec.pop("answer", {}))
            out["teacher_forced"]["stages"].append(rec)
            if not rec["ok"]:
                report(f"  {rec['error']}")
                break
            x = y
        else:
            got = np.load(x).reshape(-1).tolist()
            out["teacher_forced"].update(agreement(got, reference))
            report(f"  top-1 agreement with the bf16 reference: {out['teacher_forced']['top1_agreement']}")
        rule = CapRule(caps.worker_fraction, whole, caps.worker_at_least_plan, caps.worker_base_bytes)
        out["fleet"] = run_capped_fleet(model_path, precision, rule, context_length=context_length,
                                        streams=streams, tokens=tokens, exact=exact, report=report, log_dir=work)
    finally:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    return out


def judge(result: dict[str, Any], precisions: Sequence[str], tokens: int, streams: Sequence[int]) -> list[str]:
    """What a run missed (empty = passed)."""
    fails: list[str] = []
    ckpt = result["checkpoint"]["bytes"]
    ref = result["reference"]
    if not ref.get("finite"):
        fails.append("reference: non-finite logits")
    if (ref.get("distinct_argmax") or 0) < min(MIN_DISTINCT_ARGMAX, ref.get("positions", 0)):
        fails.append(f"reference: degenerate, {ref.get('distinct_argmax')} distinct greedy tokens")
    for p in precisions:
        r = result["precisions"].get(p, {})
        if r.get("error"):
            fails.append(f"{p}: {r['error']}")
            continue
        ex = r.get("export", {})
        if not ex.get("cap_bytes") or ex["cap_bytes"] - ex.get("cap_base_bytes", 0) >= ckpt:
            fails.append(f"{p}: the exporter's cap ({ex.get('cap_bytes')}) is not below the checkpoint ({ckpt})")
        for st in ex.get("stages", []):
            if not st.get("ok"):
                fails.append(f"{p}: export of layers {st['range'][0]}-{st['range'][1]}: {st.get('error')}")
        if len(ex.get("stages", [])) < len(result["ranges"]) or not all(s.get("ok") for s in ex.get("stages", [])):
            continue
        tf = r.get("teacher_forced", {})
        for i, st in enumerate(tf.get("stages", [])):
            if not st.get("ok"):
                fails.append(f"{p}: teacher-forced stage {i}: {st.get('error')}")
        if tf.get("top1_agreement") is None:
            fails.append(f"{p}: no teacher-forced agreement")
        fleet = r.get("fleet", {})
        if fleet.get("error"):
            fails.append(f"{p}: fleet: {fleet['error']}")
        for w in fleet.get("workers", []):
            if w.get("oom_kills"):
                fails.append(f"{p}: stage {w['stage']}'s agent group had {w['oom_kills']} OOM kill(s) under "
                             f"{(w.get('cap_bytes') or 0) / 1e9:.2f} GB")
            if not w.get("cap_below_model"):
                fails.append(f"{p}: stage {w['stage']}'s cap {(w.get('cap_bytes') or 0) / 1e9:.2f} GB is not below "
                             f"the whole model ({r.get('model_bytes', 0) / 1e9:.2f} GB): the plan asks "
                             f"{(w.get('planned_process_bytes') or 0) / 1e9:.2f} GB for its process")
        for n in streams:
            run = fleet.get("runs", {}).get(str(n))
            if run is None:
                if not fleet.get("error"):
                    fails.append(f"{p}: no run with {n} stream(s)")
                continue
            if run["errors"] or any(t != tokens for t in run["tokens"]):
                fails.append(f"{p}: {n} stream(s) gave {run['tokens']} tokens of {tokens}; {run['errors']}")
        fill = fleet.get("fill")
        if fill is not None and (fill["errors"] or not fill.get("prompt_tokens")):
            fails.append(f"{p}: the fill run (prompts filling the context) failed: {fill['errors']}")
    return fails


def _raise_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench._cgroup import CgroupError, require_v1
    from engine.bench._checkpoint import CheckpointError, checkpoint_bytes, checkpoint_root, ensure_checkpoint
    from engine.bench._reference import cached_teacher_forced
    from engine.pipeline.runner import even_split

    try:
        require_v1()
    except CgroupError as e:
        raise SystemExit(f"flotilla bench scale needs cgroup-v1 memory groups: {e}") from None
    precisions = [p.strip() for p in str(args.precisions).split(",") if p.strip()]
    streams = [int(s) for s in str(args.streams).split(",") if s.strip()]
    if not 0 < args.export_cap < 1 or not 0 < args.worker_cap < 1:
        raise SystemExit("--export-cap and --worker-cap are fractions in (0, 1): a cap must be below what it caps")
    from engine.shards.export import PRECISIONS as KNOWN

    unknown = [p for p in precisions if p not in KNOWN]
    if unknown or not precisions:
        raise SystemExit(f"--precisions: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(KNOWN)}")
    spec = spec_for(bool(args.quick), args.shape)
    t0 = time.monotonic()
    try:
        path = ensure_checkpoint(spec, report=report)
    except CheckpointError as e:
        raise SystemExit(f"flotilla bench scale: {e}") from None
    built_s = round(time.monotonic() - t0, 1)
    ckpt = checkpoint_bytes(path)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    report(f"checkpoint {path.name}: {ckpt / 1e9:.2f} GB in {len(files)} files")
    ids = teacher_forced_ids(path, args.positions)
    ref = cached_teacher_forced(path, ids, checkpoint_root(), report=report)
    took = "cached" if ref["cached"] else f"{ref['seconds']} s"
    report(f"reference: {ref['distinct_argmax']} distinct greedy tokens over {ref['positions']} positions, "
           f"finite {ref['finite']} ({took})")
    ranges = even_split(spec.num_layers, 2)
    caps = Caps(export_fraction=args.export_cap, worker_fraction=args.worker_cap)
    result: dict[str, Any] = {
        "checkpoint": {"name": spec.name, "path": str(path), "bytes": ckpt, "files": files,
                       "params": spec.params,
                       "params_b": round(spec.params / 1e9, 3), "spec": asdict(spec), "build_or_check_s": built_s},
        "reference": {k: v for k, v in ref.items() if k != "argmax"},
        "ranges": [list(r) for r in ranges], "positions": len(ids), "tokens_per_stream": args.tokens,
        "streams": streams, "context_length": args.context, "exact": bool(args.exact),
        "caps": asdict(caps),
        "precisions": {},
    }
    work = Path(tempfile.mkdtemp(prefix="flotilla-bench-scale-"))
    # SIGTERM would end us without `finally`: agents, workers and memory groups must always go.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for p in precisions:
            result["precisions"][p] = measure_precision(
                path, p, caps, ckpt_bytes=ckpt, ranges=ranges, layers=spec.num_layers, ids=ids,
                reference=ref["argmax"], context_length=args.context, streams=streams, tokens=args.tokens,
                exact=bool(args.exact), work=work, report=report)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for npy in work.glob("*.npy"):  # keep the logs (small), not the tensors
            npy.unlink(missing_ok=True)
    result["logs"] = str(work)
    failures = judge(result, precisions, args.tokens, streams)
    result["passed"] = not failures
    result["failures"] = failures
    return result

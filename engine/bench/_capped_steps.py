"""One-shot steps of `flotilla bench scale`, each a fresh process in its own capped memory group.

    export   engine.shards.export.ensure_shard of one layer range (the exporter a user's PC runs)
    forward  one shard run over n teacher-forced positions (engine.shards.runtime):
             stage 0 reads token ids, the others the previous stage's hidden states; the last
             writes the greedy next token of every position
    baseline import what a step (or an agent and its worker) imports, hold nothing: the memory a
             process of that kind needs with no model (tests cap small models at baseline +
             a fraction of the model, as the interpreter and libraries alone outweigh them)

`run_capped` starts `python -m engine.bench._capped_steps STEP ...` in a MemoryGroup from birth
and returns what it used: the group's max_usage (page cache included), the process's VmHWM
(wait4's ru_maxrss, exact) and its sampled RssAnon peak, OOM kills, the exit code, the time.
A step answers with one JSON file (--out); the parent never imports torch or OpenVINO for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from engine.bench._cgroup import MemoryGroup, PeakSampler, read_status

REPO_ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _tail(path: Path, n: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_capped(name: str, cap_bytes: int, step_argv: Sequence[str], log_path: Path, *,
               timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run one step under a cap; its answer (--out JSON) merged with the measurements."""
    out = log_path.with_suffix(".json")
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "engine.bench._capped_steps", *map(str, step_argv), "--out", str(out)]
    t0 = time.monotonic()
    timed_out = False
    with MemoryGroup(name, cap_bytes) as group, open(log_path, "ab") as log:
        proc = group.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                           cwd=str(REPO_ROOT), start_new_session=True)
        with PeakSampler(group, pids=[proc.pid]) as sampler:
            try:
                rc = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                for pid in group.pids():
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                rc = proc.wait(30)
        stats = group.stats()
    seconds = time.monotonic() - t0
    peak = sampler.peak(proc.pid)
    answer = json.loads(out.read_text()) if out.exists() else None
    # VmHWM only grows: the step's own last reading (exact) or the sampler's (<= 0.1 s old at a kill).
    # (wait4's ru_maxrss would count the parent's pages the fork copied before exec.)
    max_rss = max(peak.vm_hwm_bytes if peak else 0, (answer or {}).pop("_vm_hwm_bytes", 0))
    anon = max(peak.rss_anon_peak_bytes if peak else 0, (answer or {}).pop("_rss_anon_bytes", 0))
    result: dict[str, Any] = {
        "ok": rc == 0 and out.exists(), "returncode": rc, "seconds": round(seconds, 2),
        "cap_bytes": stats.limit_bytes, "cgroup_max_usage_bytes": stats.max_usage_bytes,
        "failcnt": stats.failcnt, "oom_kills": stats.oom_kills,
        "vm_hwm_bytes": max_rss, "rss_anon_peak_bytes": anon,
        "rss_file_at_anon_peak_bytes": peak.rss_file_at_anon_peak_bytes if peak else None,
        "timed_out": timed_out, "log": str(log_path),
    }
    if answer is not None:
        result["answer"] = answer
    if not result["ok"]:
        why = ("killed by the OOM killer" if stats.oom_kills else
               f"timed out after {timeout_s:.0f} s" if timed_out else f"exit code {rc}")
        result["error"] = f"{name}: {why} (cap {stats.limit_bytes / 1e9:.2f} GB, peak charged " \
                          f"{stats.max_usage_bytes / 1e9:.2f} GB, VmHWM {max_rss / 1e9:.2f} GB)"
        result["log_tail"] = _tail(log_path)
    return result


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


# -- the child side ---------------------------------------------------------------------------------


def _export(a: argparse.Namespace) -> dict[str, Any]:
    from engine.shards.export import ensure_shard

    cache = Path(a.cache)
    before = {p.name for p in cache.iterdir()} if cache.exists() else set()
    t0 = time.monotonic()
    info = ensure_shard(Path(a.model), a.start, a.end, num_layers_total=a.layers, precision=a.precision,
                        cache=cache)
    return {"path": str(info.path), "shard_bytes": folder_bytes(Path(info.path)),
            "export_s": round(time.monotonic() - t0, 2), "cached": Path(info.path).name in before,
            "precision": info.precision, "range": [info.start, info.end]}


def _forward(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from engine.shards.runtime import ShardRunner

    t0 = time.monotonic()
    runner = ShardRunner(Path(a.shard), exact=a.exact)
    compile_s = time.monotonic() - t0
    info = runner.info
    x = np.load(a.input)  # [1, n] int64 ids (first stage) or [1, n, H] f32 hidden states
    n = x.shape[1]
    stream = runner.new_stream()
    name = "input_ids" if info.first else "hidden_states"
    t1 = time.monotonic()
    method = "one prefill"
    if not info.last:
        out = stream.run({name: x, "attention_mask": np.ones((1, n), np.int64),
                          "position_ids": np.arange(n, dtype=np.int64)[None]})
        np.save(a.output, out["hidden_states_out"])  # [1, n, H]
    else:
        # One position at a time with the KV cache, as generation runs the head (logits_to_keep
        # 1): logits of all n rows in one call made the int4/int8 last stage of the 1B quick
        # model peak at 1.16 GB (VmHWM) and be OOM-killed at a 0.77 GB cap, a cost a user never
        # pays; the answers are the same.
        method = f"{n} single-position steps"
        tokens = []
        for t in range(n):
            one = {name: x[:, t:t + 1], "attention_mask": np.ones((1, t + 1), np.int64),
                   "position_ids": np.array([[t]], np.int64)}
            if "logits_to_keep" in runner.input_names:
                one["logits_to_keep"] = np.array([1], np.int64)
            step = stream.run(one)
            tokens.append(int(step["next_token"].reshape(-1)[-1]))
        nxt = np.array([tokens], np.int64)
        np.save(a.output, nxt.astype(np.int64))
    return {"positions": n, "compile_s": round(compile_s, 2), "run_s": round(time.monotonic() - t1, 2),
            "method": method}


# Modules each kind of process imports (baseline step).
BASELINE_MODULES = {
    "export": ("torch", "transformers", "transformers.models.llama.modeling_llama", "openvino", "nncf",
               "engine.shards.export"),
    "forward": ("openvino", "engine.shards.runtime"),
    "agent": ("engine.fleet.agent", "engine.fleet.agent_process"),
    "worker": ("openvino", "engine.shards.worker"),
}


def _baseline(a: argparse.Namespace) -> dict[str, Any]:
    import importlib

    for name in BASELINE_MODULES[a.kind]:
        importlib.import_module(name)
    if a.kind in ("forward", "worker"):  # a compiled-model runtime exists in those processes
        import openvino as ov

        ov.Core().get_property("CPU", "FULL_DEVICE_NAME")
    return {"kind": a.kind}


def measure_baseline(kind: str, log_dir: Path, cap_bytes: int = 8 << 30) -> int:
    """Bytes a process of this kind holds with no model: max(its cgroup's peak, its VmHWM)."""
    rec = run_capped(f"baseline-{kind}", cap_bytes, ["baseline", "--kind", kind], Path(log_dir) / f"baseline-{kind}.log")
    if not rec["ok"]:
        raise RuntimeError(f"baseline {kind}: {rec.get('error')}\n{rec.get('log_tail')}")
    return max(rec["cgroup_max_usage_bytes"], rec["vm_hwm_bytes"])


def measure_baselines(kinds: Sequence[str], log_dir: Path) -> dict[str, int]:
    """measure_baseline of several kinds at once (one process each, in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(kinds)) as pool:
        return dict(zip(kinds, pool.map(lambda k: measure_baseline(k, log_dir), kinds)))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench._capped_steps")
    sub = p.add_subparsers(dest="step", required=True)
    e = sub.add_parser("export")
    e.add_argument("--model", required=True)
    e.add_argument("--start", type=int, required=True)
    e.add_argument("--end", type=int, required=True)
    e.add_argument("--layers", type=int, required=True)
    e.add_argument("--precision", required=True)
    e.add_argument("--cache", required=True)
    f = sub.add_parser("forward")
    f.add_argument("--shard", required=True)
    f.add_argument("--input", required=True)
    f.add_argument("--output", required=True)
    f.add_argument("--exact", action="store_true")
    b = sub.add_parser("baseline")
    b.add_argument("--kind", choices=sorted(BASELINE_MODULES), required=True)
    for q in (e, f, b):
        q.add_argument("--out", required=True, help="answer JSON")
    a = p.parse_args(argv)
    answer = {"export": _export, "forward": _forward, "baseline": _baseline}[a.step](a)
    me = read_status(os.getpid()) or {}
    answer.update({"_vm_hwm_bytes": me.get("VmHWM", 0), "_rss_anon_bytes": me.get("RssAnon", 0)})
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps(answer))
    tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

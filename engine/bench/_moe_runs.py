"""One measured `flotilla bench moe` run: open the MoE engine, run concurrent requests
through it and take its figures, in this process or in a child inside a capped memory
group (engine/bench/_moe_cell.py); and the disk probe with the engine's reader.
"""

from __future__ import annotations

import gc
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

COMPUTE_PHASES = ("attention", "experts", "head")  # the scheduler's steps timed per token (scheduler.PHASES)
PROMPTS = ["Once upon a time", "The robot walked into", "Tell me about the sea", "A small cat",
           "In the morning the", "She opened the door and", "Why is the sky", "The old man said"]
CONTEXT = 512  # KV reserved per request in the benchmark's engines (prompts + tokens fit)
# Benchmark-only variants: a scheduler with one engine setting changed, run beside it.
# bevy_verify_always: Bevy checking an expert's checksum on every read, not only on its first read
# and after its file changed (MoEConfig.verify): what checking every read would cost it.
# bevy_widened: Bevy with every matmul widened to f32 (MoEConfig.compute "f32"): on a CPU with a
# bf16 kernel, what "auto"'s 16-bit matmuls gain, and (its answers being the exact ones) what they
# change. bevy_native: Bevy with every matmul in torch's 16-bit product (compute "native"): on a CPU
# without one (AVX2), where "auto" widens, what the widening kernels gain over torch's own product.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"bevy_verify_always": ("bevy", {"verify": "always"}),
                                                   "bevy_widened": ("bevy", {"compute": "f32"}),
                                                   "bevy_native": ("bevy", {"compute": "native"})}


def open_engine(store_dir, model_id: str, sched: str, budget: int | None, conc: int, direct: bool,
                torch_threads: int | None = None):
    """The engine of one run. budget None: the engine's own (what this process's memory leaves);
    torch_threads None: the engine's own."""
    from engine.moe.engine import MoEConfig, MoEEngine

    scheduler, changed = VARIANTS.get(sched, (sched, {}))
    cfg = MoEConfig(scheduler=scheduler, cache_budget_bytes=budget, direct_io=direct, max_concurrent=conc,
                    context_length=CONTEXT, torch_threads=torch_threads, **changed)
    return MoEEngine(store_dir, model_id, cfg)


def one_run(store_dir, model_id: str, sched: str, budget: int | None, conc: int, tokens: int,
            direct: bool, torch_threads: int | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """(figures of one run, the io_info() of the store its engine read through)."""
    return measure(open_engine(store_dir, model_id, sched, budget, conc, direct, torch_threads), sched, conc, tokens)


def measure(engine, sched: str, conc: int, tokens: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Run conc requests of `tokens` tokens through an open engine, then close it."""
    from engine.moe.scheduler import PHASES
    from engine.platform.memory import settled_heap
    from engine.protocol.messages import GenerateRequest, SamplingParams

    # As in `flotilla chat` and `serve`: the loaded libraries' heap frozen, so no full collection
    # of the cyclic GC (one took 0.2-0.3 s here, by hand) lands in the measured window.
    with settled_heap(), _GcPauses() as pauses:
        try:
            reqs = [GenerateRequest(f"b{i}", prompt=PROMPTS[i % len(PROMPTS)],
                                    sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)) for i in range(conc)]
            st0 = engine.stats()  # before the requests (the engine loop waiting for them)
            idle0, phase0 = st0["disk_idle_s"], st0["phase_s"]
            use0 = _usage()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as pool:
                answers = list(pool.map(lambda r: list(engine.stream(engine.submit(r))), reqs))
            wall = time.perf_counter() - t0
            use = {k: v - use0[k] for k, v in _usage().items()}
            st = engine.stats()
            # the window the engine's counters cover: to this snapshot (the engine loop may have
            # waited a little after the last answer; that disk idle time is in `st`)
            span = time.perf_counter() - t0
            gc_s = pauses.seconds
            idle = {p: st["disk_idle_s"].get(p, 0.0) - idle0.get(p, 0.0) for p in PHASES}
            phase = {p: st["phase_s"].get(p, 0.0) - phase0.get(p, 0.0) for p in COMPUTE_PHASES}
            guessed = st["speculative_reads"] * engine.store.index.blob_bytes  # prefetch's, bevy_guess's
            io_info = engine.store.io_info()
            cache_budget = engine.memory["cache_budget_bytes"]
            compute = engine.memory["compute"]
            threads = engine.torch_threads
        finally:
            engine.close()
    finals = [events[-1] for events in answers]
    for f in finals:
        if f.error:
            raise RuntimeError(f"{sched}: request failed: {f.error}")
    out_tokens = sum(f.usage.completion_tokens for f in finals)
    tpot = [(f.timings.total_s - f.timings.ttft_s) / (f.usage.completion_tokens - 1)
            for f in finals if f.usage.completion_tokens > 1]
    return {"tok_s": out_tokens / wall, "s_per_token": wall / out_tokens,
            "tpot_s": statistics.mean(tpot) if tpot else 0.0, "hit_rate": st["hit_rate"],
            "mb_per_token": st["bytes_read"] / 1e6 / out_tokens, "mean_group": st["mean_group"],
            # of those, bytes read on a guess (prefetch's prediction, bevy_guess's idle-fill) no request used
            "mb_unused_per_token": st["unused_bytes"] / 1e6 / out_tokens,
            "guess_reads": st["guess_reads"],
            # of the reads made on a guess, the share a request used (absent: no guesses)
            **({"guesses_used_frac": 1.0 - st["unused_bytes"] / guessed} if guessed else {}),
            "mean_batch": st["mean_batch"],
            # share of the request passes Bevy started while it moved its requests in two waves
            "two_waves_frac": st["two_wave_passes"] / st["passes"] if st["passes"] else 0.0,
            "disk_mb_s_busy": st["bytes_read"] / 1e6 / st["io_busy_s"] if st["io_busy_s"] else 0.0,
            "io_busy_frac": st["io_busy_s"] / span, "compute_frac": st["compute_s"] / span,
            # share of the wall time the disk had nothing to read, by what the scheduler did then
            "disk_idle_frac": sum(idle.values()) / span,
            **{f"disk_idle_{p}_frac": idle[p] / span for p in PHASES},
            "compute_s_per_token": st["compute_s"] / out_tokens, "cache_budget_mb": cache_budget / 1e6,
            # of the compute, the scheduler thread's time per token in each step (the rest: its bookkeeping)
            **{f"{p}_s_per_token": phase[p] / out_tokens for p in COMPUTE_PHASES},
            # the process's CPU time (every thread), of it the OS's (page faults, reads), and page
            # faults that read a file (the capped group evicting code or resident weights), per token
            **{f"{k}_per_token": v / out_tokens for k, v in use.items()},
            # time the process stood still for the cyclic GC's collections (any thread's)
            "gc_s_per_token": gc_s / out_tokens,
            # not figures: what the answers were and how the matmuls ran (moe.py compares the answers)
            "token_ids": [[t for e in events for t in e.token_ids] for events in answers],
            "compute": compute, "torch_threads": threads}, io_info


class _GcPauses:
    """Within `with`: the seconds the cyclic GC's collections took (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> "_GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _usage() -> dict[str, float]:
    """This process's CPU seconds so far (every thread); where the OS reports them (not
    Windows), of those the system's, and the major page faults."""
    try:
        import resource
    except ImportError:
        return {"cpu_s": time.process_time()}
    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": u.ru_utime + u.ru_stime, "cpu_sys_s": u.ru_stime, "major_faults": float(u.ru_majflt)}


def same_tokens(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two runs' answers (request by request) hold the same token."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    total = max(sum(map(len, a)), sum(map(len, b)), 1)
    return sum(x == y for x, y in pairs) / total


def capped_run(cell: dict[str, Any], cap: int) -> tuple[dict[str, float], dict[str, Any]]:
    """one_run in a child process inside a memory group capped at `cap` bytes; its figures
    plus the group's peak, limit hits and OOM kills and the child's anonymous peak."""
    import json
    import subprocess
    import sys

    from engine.bench._cgroup import MemoryGroup, PeakSampler

    argv = [sys.executable, "-m", "engine.bench._moe_cell", json.dumps(cell)]
    with MemoryGroup(f"moe-{cell['sched']}-{cell['conc']}", cap) as group:
        proc = group.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with PeakSampler(group, interval=0.2) as sampler:
            out, err = proc.communicate(timeout=3600)
        stats = group.stats()
    if proc.returncode != 0 or not out.strip():
        why = "OOM-killed" if stats.oom_kills else f"exit {proc.returncode}"
        raise RuntimeError(f"{cell['sched']} c={cell['conc']} under a {cap / 1e6:.0f} MB cap: {why}: "
                           f"{' '.join(err.split())[-600:]}")
    m, info = json.loads(out.strip().splitlines()[-1])
    peak = max((p.rss_anon_peak_bytes for p in sampler.peaks()), default=0)
    m.update(group_max_usage_mb=stats.max_usage_bytes / 1e6, failcnt=stats.failcnt, oom_kills=stats.oom_kills,
             rss_anon_peak_mb=peak / 1e6)
    return m, info


def capped_above_setup(cell: dict[str, Any], budget: int) -> tuple[dict[str, float], dict[str, Any]]:
    """one_run in a child whose memory group is capped, once its engine is set up, at its
    usage then + 16 MiB + the cache budget (the sparse bench's rule for tiny models)."""
    import json

    from engine.sparse.baseline import run_capped_child

    r = run_capped_child(["engine.bench._moe_cell", json.dumps({**cell, "handshake": True})], budget,
                         what=f"{cell['sched']} c={cell['conc']}")
    m = r["figures"]
    m.update(group_max_usage_mb=r["max_usage_bytes"] / 1e6, group_limit_mb=r["cgroup_limit_bytes"] / 1e6,
             setup_usage_mb=r["setup_usage_bytes"] / 1e6, oom_kills=r["oom_kills"])
    return m, r["io_info"]


def above_setup_cap(cells: dict, budget: int) -> dict[str, Any]:
    runs = [r for rs in cells.values() for r in rs]
    return {"rule": "above_setup: each run's memory group is capped, once its engine is set up, at the "
                    "usage then + 16 MiB + the cache budget",
            "cache_budget_mb": round(budget / 1e6, 3),
            "max_over_setup_mb": round(max(r["group_max_usage_mb"] - r["setup_usage_mb"] for r in runs), 1),
            "oom_kills": sum(r["oom_kills"] for r in runs), "context_per_request": CONTEXT}


def disk_bandwidth(store, n: int = 96, threads: int = 4) -> float:
    """Bytes/s reading random blobs with the engine's reader (the store's io_mode, thread pool)."""
    import random

    from engine.platform.pread import aligned_buffer

    import threading

    keys = random.Random(0).sample(store.keys, min(n, len(store.keys)))
    local = threading.local()  # one aligned buffer per reader thread

    def read(key) -> None:
        if not hasattr(local, "buf"):
            local.buf = aligned_buffer(store.index.blob_bytes)
        store.read_into(key, local.buf)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, keys))
    return len(keys) * store.index.blob_bytes / (time.perf_counter() - t)

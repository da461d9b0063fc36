"""`flotilla bench chaos`: a pipeline under fire. Streams must survive peer kills.

A local pipeline (3 stage processes, f32 so greedy answers are exact) serves
16 client threads that send requests back to back; every --kill-every s a
random stage process is killed with SIGKILL. Each answer is compared with the
same request's answer from an uninterrupted run before the chaos:

- requests / completed: answers that ended normally (stop or length);
- duplicated_tokens / lost_tokens: tokens shown twice / never shown, from an
  alignment of each answer with its reference (difflib opcodes: insert =
  duplicated, delete = lost); mismatched_tokens: replaced ones;
- identical: answers equal to the reference token for token;
- max_recovery_s: kill -> every stream that was running had its next token
  (the engine's RecoveryRecord.resume_s plus the detection delay);
- worker_rss_growth_mb: the largest RSS growth of one worker process from its
  first sample (after it served) to its last (KV states of replayed streams
  must be freed on survivors: a leak shows here).

Goal: completed == requests, 0 duplicated, 0 lost, max_recovery_s < 5.
--quick lasts about a minute; the full run 10 minutes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import random
import signal
import statistics
import threading
import time
from typing import Any, Callable

NAME = "chaos"
HELP = "reliability: 3 stages, 16 streams, a random stage killed every N s; no token lost or duplicated"

PROMPTS = ["Tell me a story about a robot.", "What is the sea like in winter?", "Write a poem about cats.",
           "Explain how a bicycle works.", "Describe a busy market.", "Why do leaves fall?",
           "Plan a trip to the mountains.", "What did the old man say?"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model spec (default demo)")
    p.add_argument("--stages", type=int, default=3, help="stage processes (default 3)")
    p.add_argument("--streams", type=int, default=16, help="concurrent client streams (default 16)")
    p.add_argument("--kill-every", type=float, default=None, help="seconds between kills (default 8 quick, 20 full)")
    p.add_argument("--duration", type=float, default=None, help="seconds of chaos (default 60 quick, 600 full)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per answer at most (default 160)")
    p.add_argument("--seed", type=int, default=0, help="which stage dies when (default 0)")


def _align(got: list[int], want: list[int]) -> tuple[int, int, int]:
    """(duplicated, lost, mismatched) tokens of an answer against its reference."""
    if got == want:
        return 0, 0, 0
    dup = lost = bad = 0
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, want, got, autojunk=False).get_opcodes():
        if op == "insert":
            dup += b1 - b0
        elif op == "delete":
            lost += a1 - a0
        elif op == "replace":
            bad += max(a1 - a0, b1 - b0)
    return dup, lost, bad


class _RssWatch:
    """First and last RSS of every worker process (sampled once a second); the first
    sample is taken once a worker has served WARM_S (loading a shard is not growth)."""

    WARM_S = 5.0

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def sample(self, pids: list[int]) -> None:
        import psutil

        now = time.monotonic()
        for pid in pids:
            self.seen.setdefault(pid, now)
            if now - self.seen[pid] < self.WARM_S:
                continue
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except (psutil.Error, OSError):
                continue
            self.first.setdefault(pid, rss)
            self.last[pid] = rss

    def growth_mb(self) -> float:
        return max((self.last[p] - self.first[p] for p in self.first), default=0.0)


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.pipeline.runner import FleetConfig, launch_pipeline
    from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

    quick = bool(getattr(args, "quick", False))
    duration = args.duration if args.duration is not None else (60.0 if quick else 600.0)
    kill_every = args.kill_every if args.kill_every is not None else (8.0 if quick else 20.0)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    rng = random.Random(args.seed)

    def request(rid: str, k: int) -> GenerateRequest:
        return GenerateRequest(rid, messages=(ChatMessage("user", PROMPTS[k % len(PROMPTS)]),), sampling=sampling)

    report(f"chaos: launching {args.stages} stages of {args.model}")
    engine = launch_pipeline(FleetConfig(model=args.model, stages=args.stages, exact=True,
                                         max_concurrent=args.streams, spares=1))
    try:
        report("chaos: reference answers (no faults)")
        refs: dict[int, list[int]] = {}
        ids = {k: engine.submit(request(f"ref-{k}", k)) for k in range(len(PROMPTS))}
        for k, rid in ids.items():
            refs[k] = [t for ev in engine.stream(rid, timeout=60) for t in ev.token_ids]

        rss = _RssWatch()
        results: list[dict] = []
        lock = threading.Lock()
        stop = threading.Event()
        kills: list[tuple[float, int, int]] = []  # (monotonic, ring position, pid)

        def client(c: int) -> None:
            n = 0
            while not stop.is_set():
                k = (c + n) % len(PROMPTS)
                rid = f"c{c}-{n}"
                n += 1
                got: list[int] = []
                final = None
                try:
                    engine.submit(request(rid, k))
                    for ev in engine.stream(rid, timeout=60):
                        got += ev.token_ids
                        if ev.final:
                            final = ev
                except Exception as e:  # noqa: BLE001 - a hang or a refusal is a failed request
                    final = None
                    err = f"{type(e).__name__}: {e}"
                else:
                    err = final.error if final is not None else "no final event"
                if final is None and engine.load().state == "broken":
                    stop.set()  # nothing will answer any more: count this one and stop
                dup, lost, bad = _align(got, refs[k])
                ok = final is not None and final.finish_reason in ("stop", "length")
                with lock:
                    results.append({"ok": ok, "identical": got == refs[k], "dup": dup, "lost": lost,
                                    "bad": bad, "error": None if ok else err,
                                    "usage_ok": final is not None and final.usage is not None
                                    and final.usage.completion_tokens == len(got)})

        def workers() -> list[int]:
            return [link.proc.pid for link in engine.stages if link.proc is not None and link.proc.poll() is None]

        clients = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.streams)]
        t_start = time.monotonic()
        for t in clients:
            t.start()
        report(f"chaos: {args.streams} streams for {duration:.0f} s, a stage killed every {kill_every:.0f} s")
        next_kill = t_start + kill_every
        time.sleep(1.0)
        rss.sample(workers())
        while time.monotonic() - t_start < duration:
            time.sleep(0.25)
            now = time.monotonic()
            if int(now * 4) % 4 == 0:
                rss.sample(workers())
            if now >= next_kill:
                next_kill = now + kill_every
                if engine.recovery.state != "ok" or engine.recovery.paused:
                    continue  # one fault at a time: the next one after this recovery
                i = rng.randrange(len(engine.stages))
                link = engine.stages[i]
                if link.proc is None or link.proc.poll() is not None:
                    continue
                rss.sample(workers())
                os.kill(link.proc.pid, signal.SIGKILL)
                kills.append((time.monotonic(), i, link.proc.pid))
                report(f"chaos: t={now - t_start:5.1f} s killed stage {i} (pid {link.proc.pid})")
        stop.set()
        for t in clients:
            t.join(timeout=120)
        rss.sample(workers())
        records = list(engine.recovery.records)
        recov = []
        for t_kill, _i, pid in kills:
            rec = next((r for r in records if f"pid {pid})" in r.reason and r.detected >= t_kill - 0.01), None)
            if rec is None or not rec.ok:
                recov.append(float("inf"))
            else:
                recov.append(rec.detected + rec.resume_s - t_kill)
        finite = [r for r in recov if r != float("inf")]
        out = {
            "stages": args.stages, "streams": args.streams, "duration_s": round(duration, 1),
            "kill_every_s": kill_every, "kills": len(kills),
            "recoveries": sum(1 for r in records if r.ok),
            "requests": len(results),
            "completed": sum(r["ok"] for r in results),
            "identical": sum(r["identical"] for r in results),
            "duplicated_tokens": sum(r["dup"] for r in results),
            "lost_tokens": sum(r["lost"] for r in results),
            "mismatched_tokens": sum(r["bad"] for r in results),
            "usage_mismatches": sum(not r["usage_ok"] for r in results if r["ok"]),
            "max_recovery_s": round(max(recov), 3) if recov else 0.0,
            "median_recovery_s": round(statistics.median(finite), 3) if finite else 0.0,
            "detect_s": [round(r.detected - k[0], 3) for k, r in zip(kills, records)],
            "worker_rss_growth_mb": round(rss.growth_mb(), 1),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            "recovery_records": [r.to_dict() for r in records][:50],
        }
        report(f"chaos: {out['completed']}/{out['requests']} completed, {out['duplicated_tokens']} duplicated, "
               f"{out['lost_tokens']} lost, max recovery {out['max_recovery_s']} s, "
               f"worker RSS growth {out['worker_rss_growth_mb']} MB")
        return out
    finally:
        engine.close()

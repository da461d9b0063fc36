"""`flotilla bench chaos`: a pipeline under fire. Streams must survive peer kills.

A local pipeline (3 stage processes, f32 so greedy answers are exact) serves
16 client threads that send requests back to back; every --kill-every s a
random stage process is killed with SIGKILL. Each answer is compared with the
same request's answer from an uninterrupted run before the chaos:

- submitted = completed + failed + unfinished: every request a client sent
  (a refused submit included); completed = ended normally (stop or length),
  failed = ended with an error, a hang (stream timeout) or a refusal,
  unfinished = still running when the run stopped waiting (--drain-timeout s
  after the chaos); requests = completed + failed (answers that ended);
- duplicated_tokens / lost_tokens: tokens shown twice / never shown, from an
  alignment of each answer with its reference (difflib opcodes: insert =
  duplicated, delete = lost); mismatched_tokens: replaced ones;
- identical: answers equal to the reference token for token;
- max_recovery_s: kill -> every stream that was running had its next token
  (the engine's RecoveryRecord.resume_s plus the detection delay);
- worker_rss_growth_mb: the largest RSS growth of one worker process from its
  first sample (after it served) to its last (KV states of replayed streams
  must be freed on survivors: a leak shows here).

Goal (RECOVERY_GOAL_S, --recovery-goal): every submitted request completed, 0
duplicated, 0 lost, 0 mismatched, every kill recovered, max_recovery_s < 5,
at least one kill. "passed" says whether the run met it and "failures" lists
what it missed (flotilla bench exits non-zero when passed is false).
--quick lasts about a minute; the full run 10 minutes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

NAME = "chaos"
HELP = "reliability: 3 stages, 16 streams, a random stage killed every N s; no token lost or duplicated"

PROMPTS = ["Tell me a story about a robot.", "What is the sea like in winter?", "Write a poem about cats.",
           "Explain how a bicycle works.", "Describe a busy market.", "Why do leaves fall?",
           "Plan a trip to the mountains.", "What did the old man say?"]


RECOVERY_GOAL_S = 5.0  # kill -> every running stream had its next token (docs/reliability.md)
DRAIN_TIMEOUT_S = 120.0  # after the chaos: how long running requests may take to end


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model spec (default demo)")
    p.add_argument("--stages", type=int, default=3, help="stage processes (default 3)")
    p.add_argument("--streams", type=int, default=16, help="concurrent client streams (default 16)")
    p.add_argument("--kill-every", type=float, default=None, help="seconds between kills (default 8 quick, 20 full)")
    p.add_argument("--duration", type=float, default=None, help="seconds of chaos (default 60 quick, 600 full)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per answer at most (default 160)")
    p.add_argument("--seed", type=int, default=0, help="which stage dies when (default 0)")
    p.add_argument("--recovery-goal", type=float, default=RECOVERY_GOAL_S,
                   help=f"max recovery (kill -> next token) in s for the run to pass (default {RECOVERY_GOAL_S:g})")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="s to wait for running requests after the chaos; those still running then are "
                        f"counted unfinished (default {DRAIN_TIMEOUT_S:g})")
    p.add_argument("--stream-timeout", type=float, default=60.0,
                   help="s a request may go without an event before it counts as failed (default 60)")


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


def judge(out: dict[str, Any], recovery_goal_s: float = RECOVERY_GOAL_S) -> list[str]:
    """What a run's figures miss of the goal (empty: it passed)."""
    failures = []
    if out["submitted"] != out["completed"] + out["failed"] + out["unfinished"]:
        failures.append(f"request counts do not add up: submitted {out['submitted']} != completed "
                        f"{out['completed']} + failed {out['failed']} + unfinished {out['unfinished']}")
    if out["submitted"] == 0:
        failures.append("no request was submitted")
    if out["failed"]:
        failures.append(f"{out['failed']} of {out['submitted']} requests failed")
    if out["unfinished"]:
        failures.append(f"{out['unfinished']} of {out['submitted']} requests were still running at the end "
                        f"(lost: no final event within the drain timeout)")
    if out["completed"] != out["identical"]:
        failures.append(f"{out['completed'] - out['identical']} completed answers differ from their reference")
    for key, what in (("duplicated_tokens", "duplicated"), ("lost_tokens", "lost"),
                      ("mismatched_tokens", "mismatched")):
        if out[key]:
            failures.append(f"{out[key]} tokens {what}")
    if out["usage_mismatches"]:
        failures.append(f"{out['usage_mismatches']} answers report a usage that is not their token count")
    if out["kills"] == 0:
        failures.append("no stage was killed: the run tested nothing (duration shorter than the kill interval?)")
    if out["unrecovered_kills"]:
        failures.append(f"{out['unrecovered_kills']} of {out['kills']} kills were not followed by a "
                        f"successful recovery")
    if out["max_recovery_s"] is not None and out["max_recovery_s"] >= recovery_goal_s:
        failures.append(f"max recovery {out['max_recovery_s']} s is not under the goal of {recovery_goal_s:g} s")
    return failures


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.pipeline.runner import FleetConfig, launch_pipeline
    from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

    quick = bool(getattr(args, "quick", False))
    duration = args.duration if args.duration is not None else (60.0 if quick else 600.0)
    kill_every = args.kill_every if args.kill_every is not None else (8.0 if quick else 20.0)
    goal = float(getattr(args, "recovery_goal", RECOVERY_GOAL_S))
    drain_timeout = float(getattr(args, "drain_timeout", DRAIN_TIMEOUT_S))
    stream_timeout = float(getattr(args, "stream_timeout", 60.0))
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)  # every answer runs its full length
    rng = random.Random(args.seed)

    def request(rid: str, k: int) -> GenerateRequest:
        return GenerateRequest(rid, messages=(ChatMessage("user", PROMPTS[k % len(PROMPTS)]),), sampling=sampling)

    report(f"chaos: launching {args.stages} stages of {args.model}")
    # The stages' logs: a ring whose stages die keeps them (its errors name them), and this
    # bench kills stages on purpose, so they are its own: removed after a run that passed.
    logs = Path(tempfile.mkdtemp(prefix="flotilla-chaos-"))
    engine = launch_pipeline(FleetConfig(model=args.model, stages=args.stages, exact=True,
                                         max_concurrent=args.streams, spares=1, log_dir=logs))
    passed = False
    try:
        report("chaos: reference answers (no faults)")
        refs: dict[int, list[int]] = {}
        ids = {k: engine.submit(request(f"ref-{k}", k)) for k in range(len(PROMPTS))}
        for k, rid in ids.items():
            refs[k] = [t for ev in engine.stream(rid, timeout=max(60.0, stream_timeout)) for t in ev.token_ids]

        rss = _RssWatch()
        results: list[dict] = []
        inflight: dict[str, int] = {}  # submitted (or being submitted), no outcome yet: rid -> prompt
        submitted = 0
        lock = threading.Lock()
        stop = threading.Event()
        kills: list[tuple[float, int, int]] = []  # (monotonic, ring position, pid)

        def client(c: int) -> None:
            nonlocal submitted
            n = 0
            while not stop.is_set():
                k = (c + n) % len(PROMPTS)
                rid = f"c{c}-{n}"
                n += 1
                with lock:  # counted before it is sent: a request that never ends is still counted
                    submitted += 1
                    inflight[rid] = k
                got: list[int] = []
                final = None
                try:
                    engine.submit(request(rid, k))
                    for ev in engine.stream(rid, timeout=stream_timeout):
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
                    inflight.pop(rid, None)
                    results.append({"ok": ok, "identical": got == refs[k], "dup": dup, "lost": lost,
                                    "bad": bad, "error": None if ok else (err or f"finish {final.finish_reason}"),
                                    "usage_ok": final is not None and final.usage is not None
                                    and final.usage.completion_tokens == len(got)})

        def workers() -> list[int]:
            return [link.proc.pid for link in engine.stages if link.proc is not None and link.proc.poll() is None]

        clients = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.streams)]
        t_start = time.monotonic()
        for t in clients:
            t.start()
        report(f"chaos: {args.streams} streams for {duration:g} s, a stage killed every {kill_every:g} s")
        next_kill = t_start + kill_every
        time.sleep(min(1.0, duration))
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
        drain_until = time.monotonic() + drain_timeout  # one deadline for all clients, not one each
        for t in clients:
            t.join(timeout=max(0.0, drain_until - time.monotonic()))
        rss.sample(workers())
        with lock:  # one consistent snapshot: clients still running may add to these later
            done = list(results)
            unfinished = len(inflight)
            n_submitted = submitted
        records = list(engine.recovery.records)
        for r in records:  # a recovery still under way gets what is left of the drain time
            try:
                r.done.exception(timeout=max(0.0, drain_until - time.monotonic()))
            except Exception:  # noqa: BLE001 - a timeout: it stays not ok
                pass
        recov: list[float | None] = []
        matched = []
        for t_kill, _i, pid in kills:
            rec = next((r for r in records if f"pid {pid})" in r.reason and r.detected >= t_kill - 0.01), None)
            matched.append(rec)
            recov.append(None if rec is None or not rec.ok else rec.detected + rec.resume_s - t_kill)
        finite = [r for r in recov if r is not None]
        unrecovered = sum(r is None for r in recov)
        completed = sum(r["ok"] for r in done)
        out: dict[str, Any] = {
            "stages": args.stages, "streams": args.streams, "duration_s": round(duration, 1),
            "kill_every_s": kill_every, "kills": len(kills),
            "recoveries": sum(1 for r in records if r.ok),
            "unrecovered_kills": unrecovered,
            "submitted": n_submitted,
            "completed": completed,
            "failed": len(done) - completed,
            "unfinished": unfinished,
            "requests": len(done),
            "identical": sum(r["identical"] for r in done),
            "duplicated_tokens": sum(r["dup"] for r in done),
            "lost_tokens": sum(r["lost"] for r in done),
            "mismatched_tokens": sum(r["bad"] for r in done),
            "usage_mismatches": sum(not r["usage_ok"] for r in done if r["ok"]),
            # None when a kill was never recovered from (see unrecovered_kills)
            "max_recovery_s": None if unrecovered else (round(max(finite), 3) if finite else 0.0),
            "median_recovery_s": round(statistics.median(finite), 3) if finite else 0.0,
            "recovery_s": [None if r is None else round(r, 3) for r in recov],
            "recovery_goal_s": goal,
            "detect_s": [round(rec.detected - k[0], 3) for k, rec in zip(kills, matched) if rec is not None],
            "worker_rss_growth_mb": round(rss.growth_mb(), 1),
            "drain_timeout_s": drain_timeout,
            "errors": sorted({r["error"] for r in done if r["error"]})[:5],
            "recovery_records": [r.to_dict() for r in records][:50],
        }
        out["failures"] = judge(out, goal)
        out["passed"] = passed = not out["failures"]
        out["stage_logs"] = None if passed else str(logs)  # kept to read why
        report(f"chaos: {out['completed']}/{out['submitted']} completed ({out['failed']} failed, "
               f"{out['unfinished']} unfinished), {out['duplicated_tokens']} duplicated, "
               f"{out['lost_tokens']} lost, max recovery {out['max_recovery_s']} s (goal < {goal:g} s), "
               f"worker RSS growth {out['worker_rss_growth_mb']} MB")
        report("chaos: PASSED" if passed else f"chaos: FAILED: {'; '.join(out['failures'])} (stage logs: {logs})")
        return out
    finally:
        engine.close()
        if passed:
            shutil.rmtree(logs, ignore_errors=True)

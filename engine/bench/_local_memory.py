"""Side by side on one IR: the local engine and openvino_genai.LLMPipeline, speed and memory.

Two measurements, one bench run:

- speed, interleaved in ONE process (`python -m engine.bench._local_memory --engine both ...`):
  both engines loaded, one warm-up answer each, then `rounds` rounds of one answer
  per engine, in the order A B, B A, A B, ... (neither always runs first, on a
  machine that heats up or whose load changes). Ratios ours / genai are taken per
  round, so a load spike on the machine hits both figures of the round alike;
  the figures quoted are the median and min-max over the rounds.
- memory, in a fresh child process per engine (`--engine ours|genai`), alternating,
  so peaks are separate and nothing one engine mapped or cached is counted for
  the other. The parent samples the child's /proc/PID/status every few ms for the
  peak anonymous RSS (the kernel keeps a peak for the whole RSS only, VmHWM, which
  also counts the IR's mapped file pages: clean, shared with the page cache,
  dropped first under pressure). These children time their answers too
  ("alone" figures: one engine per process).

Every answer is greedy with exactly `tokens` new tokens, the same prompt token ids for
both engines. Answer i asks "(i) " + the prompt: openvino_genai keeps the previous
call's KV and re-uses it when a prompt starts with the same tokens (its prefix
cache; the local engine keeps whole KV blocks of ended answers), so a repeated prompt
would time a cache, not a prefill. In a round both engines answer the same prompt.

Figures per answer: ttft_ms (call -> first token), decode_tok_s ((n - 1) / (last - first
token)), both by wall clock around the same call shape; cpu_ms_per_token (the process's
CPU time over the answer / n: on a machine others load, wall time measures the load too). Per memory child (bytes, s):
  load_s                 engine construction (compile; the IR is already exported)
  after_load             RssAnon / RssFile / VmRSS right after loading
  after_answers          the same after every answer (weights are repacked at the first inference)
  peak_anon              the parent's sampled maximum of RssAnon over the child's life
  vm_hwm                 the kernel's peak RSS (anonymous + mapped file pages)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ENGINES = ("ours", "genai")
SAMPLE_S = 0.005  # how often the parent reads the child's RssAnon
RESULT = "FLOTILLA-MEM "  # the child's stdout line carrying its JSON
PROGRESS = "FLOTILLA-STEP "  # a child's stdout line the parent shows as progress
_STATUS_KEYS = ("RssAnon", "RssFile", "VmRSS", "VmHWM")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """RssAnon, RssFile, VmRSS, VmHWM of a process, in bytes (from /proc/PID/status)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024  # "123 kB"
    return out


# -- the child -------------------------------------------------------------------------------------


def _prompt(prompt: str, i: int) -> str:
    """Answer i's prompt: a different start each time, so no engine re-uses an earlier prefix."""
    return f"({i}) {prompt}"


class OursRunner:
    """The local engine (as `flotilla chat` opens it: the paged engine) answering chat messages."""

    name = "ours"

    def __init__(self, ir: Path) -> None:
        from engine.local.factory import open_whole_model

        self.engine = open_whole_model(ir, "bench")

    def answer(self, prompt: str, tokens: int, tag: str) -> dict[str, float]:
        from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

        req = GenerateRequest(f"mem-{tag}", messages=(ChatMessage("user", prompt),),
                              sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
        c0, t0 = time.process_time(), time.perf_counter()
        stamps: list[float] = []
        final = None
        for ev in self.engine.stream(self.engine.submit(req), timeout=900):
            if ev.token_ids:
                stamps.extend([time.perf_counter()] * len(ev.token_ids))
            final = ev
        if final is None or final.finish_reason == "error":
            raise RuntimeError(f"our engine failed: {getattr(final, 'error', None)}")
        n = final.usage.completion_tokens if final.usage else len(stamps)
        return _figures(t0, stamps[0] if stamps else time.perf_counter(), time.perf_counter(), n, c0)

    def close(self) -> None:
        self.engine.close()


class GenaiRunner:
    """openvino_genai.LLMPipeline with its own defaults, fed the token ids our engine would run."""

    name = "genai"

    def __init__(self, ir: Path) -> None:
        import openvino_genai as ov_genai
        from transformers import AutoTokenizer

        from engine.runtime.genai_folder import genai_folder

        folder = genai_folder(ir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(ir))
        self.pipe = ov_genai.LLMPipeline(str(folder), "CPU")  # genai's own defaults

    def answer(self, prompt: str, tokens: int, tag: str) -> dict[str, float]:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        from engine.protocol.messages import ChatMessage
        from engine.runtime.chat import chat_ids

        ids = np.array([chat_ids(self.tokenizer, (ChatMessage("user", prompt),))], dtype=np.int64)  # [1, n]
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = tokens
        cfg.do_sample = False

        class Stamps(ov_genai.StreamerBase):
            """A time stamp per generated token (a text callback would be called per word)."""

            def __init__(self) -> None:
                super().__init__()
                self.times: list[float] = []

            def write(self, token):  # a token id, or a list when several come at once
                self.times.extend([time.perf_counter()] * (len(token) if isinstance(token, list) else 1))
                return ov_genai.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        streamer = Stamps()
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        c0, t0 = time.process_time(), time.perf_counter()
        result = self.pipe.generate(inputs, cfg, streamer=streamer)
        t_end = time.perf_counter()
        n = len(result.tokens[0])
        return _figures(t0, streamer.times[0] if streamer.times else t_end, t_end, n, c0)

    def close(self) -> None:
        del self.pipe


RUNNERS = {"ours": OursRunner, "genai": GenaiRunner}


def _run_alone(engine: str, ir: Path, prompt: str, tokens: int, answers: int
               ) -> tuple[float, dict, dict, list[dict]]:
    """One engine in this process: load, `answers` answers (the first one warms up)."""
    t = time.perf_counter()
    runner = RUNNERS[engine](ir)
    load_s = time.perf_counter() - t
    loaded = proc_status()
    try:
        runs = [runner.answer(_prompt(prompt, i), tokens, str(i)) for i in range(answers)]
        answered = proc_status()
    finally:
        runner.close()
    return load_s, loaded, answered, runs


def _step(text: str) -> None:
    """A progress line for the parent (measure_child shows it at once)."""
    print(PROGRESS + text, flush=True)


def _run_both(ir: Path, prompt: str, tokens: int, rounds: int) -> dict[str, Any]:
    """Both engines in this process; one warm-up answer each, then `rounds` interleaved rounds."""
    runners = {}
    load_s = {}
    try:
        for name in ENGINES:
            t = time.perf_counter()
            runners[name] = RUNNERS[name](ir)
            load_s[name] = round(time.perf_counter() - t, 2)
        warmup = {name: r.answer(_prompt(prompt, 0), tokens, "w") for name, r in runners.items()}
        per_round = []
        for i in range(rounds):
            order = ENGINES if i % 2 == 0 else ENGINES[::-1]
            got = {name: runners[name].answer(_prompt(prompt, i + 1), tokens, f"r{i}") for name in order}
            per_round.append({"order": list(order), **got})
            _step(f"  round {i + 1}/{rounds} ({' then '.join(order)}): "
                  + ", ".join(f"{e} {got[e]['decode_tok_s']:.2f} tok/s TTFT {got[e]['ttft_ms']:.0f} ms "
                              f"CPU {got[e]['cpu_ms_per_token']:.0f} ms/token" for e in ENGINES))
    finally:
        for r in runners.values():
            r.close()
    return {"load_s": load_s, "warmup": warmup, "rounds": per_round}


def _figures(t0: float, t_first: float, t_end: float, n: int, cpu0: float) -> dict[str, float]:
    """One answer's figures; cpu_ms_per_token is the process's CPU time (every thread) over
    the answer per token: what a busy machine cannot inflate the way it inflates wall time."""
    rate = (n - 1) / (t_end - t_first) if n >= 2 and t_end > t_first else 0.0
    cpu = (time.process_time() - cpu0) * 1000 / max(1, n)
    return {"ttft_ms": round((t_first - t0) * 1000, 1), "decode_tok_s": round(rate, 2), "tokens": n,
            "cpu_ms_per_token": round(cpu, 2)}


def child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench._local_memory")
    p.add_argument("--engine", choices=(*ENGINES, "both"), required=True)
    p.add_argument("--ir", type=Path, required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True, help="measured answers (both: rounds)")
    a = p.parse_args(argv)
    if a.engine == "both":
        out = {"engine": "both", **_run_both(a.ir, a.prompt, a.tokens, a.repeats)}
    else:
        load_s, loaded, answered, runs = _run_alone(a.engine, a.ir, a.prompt, a.tokens, a.repeats + 1)
        out = {"engine": a.engine, "load_s": round(load_s, 2), "after_load": loaded,
               "after_answers": answered, "warmup": runs[0], "answers": runs[1:]}
    print(RESULT + json.dumps(out), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------------------


def measure_child(engine: str, ir: Path, prompt: str, tokens: int, repeats: int,
                  progress: Callable[[str], None] | None = None, timeout: float = 1800.0) -> dict[str, Any]:
    """One fresh child process running `engine` ("ours", "genai" or "both"); its JSON plus the
    sampled peak RssAnon. The child's progress lines go to `progress` as they come."""
    from engine.bench.local import _env  # the same environment as the bench's other children

    env = _env(Path(os.environ.get("FLOTILLA_CACHE") or _default_cache()))
    argv = [sys.executable, "-m", "engine.bench._local_memory", "--engine", engine, "--ir", str(ir),
            "--prompt", prompt, "--tokens", str(tokens), "--repeats", str(repeats)]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = {"anon": 0}
    err: list[str] = []

    def sample() -> None:
        while proc.poll() is None:
            try:
                peak["anon"] = max(peak["anon"], proc_status(proc.pid).get("RssAnon", 0))
            except (OSError, ValueError):
                return
            time.sleep(SAMPLE_S)

    def drain_stderr() -> None:  # kept for the error message; a full pipe would block the child
        assert proc.stderr is not None
        err.extend(proc.stderr)

    threads = [threading.Thread(target=drain_stderr, daemon=True)]
    if engine != "both":  # a speed-only child is not sampled: the polling would cost it CPU time
        threads.append(threading.Thread(target=sample, daemon=True))
    for t in threads:
        t.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    line = None
    try:
        assert proc.stdout is not None
        for text in proc.stdout:  # ends when the child closes its stdout (it exited)
            if text.startswith(PROGRESS):
                if progress is not None:
                    progress(text[len(PROGRESS):].rstrip())
            elif text.startswith(RESULT):
                line = text[len(RESULT):]
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in threads:
            t.join(1.0)
    if proc.returncode != 0 or line is None:
        tail = " | ".join("".join(err).strip().splitlines()[-3:])
        raise RuntimeError(f"{engine} child exited with {proc.returncode}: {tail}")
    out = json.loads(line)
    out["peak_anon"] = peak["anon"]
    out["vm_hwm"] = out.get("after_answers", {}).get("VmHWM", 0)
    return out


def _default_cache() -> str:
    from engine.models.demo import cache_root

    return str(cache_root())


def _spread(values: list[float]) -> dict[str, float]:
    """Median and min-max of one figure over the child processes (or the rounds)."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


# What the issue asks of the local engine against openvino_genai on the same IR.
GOAL_DECODE = 1.0  # ours / genai decode tok/s, at least (median of the per-round ratios)
GOAL_TTFT = 1.0  # ours / genai warm time to first token, at most (median of the per-round ratios)
GOAL_MEMORY = 1.10  # ours / genai peak anonymous RSS, at most (medians over the processes)


def interleaved(ir: Path, prompt: str, tokens: int, rounds: int,
                report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Both engines in one child process, `rounds` alternating rounds; per-round ratios."""
    r = measure_child("both", ir, prompt, tokens, rounds, report)
    rows = r["rounds"]
    out: dict[str, Any] = {"rounds": rounds, "load_s": r["load_s"], "warmup": r["warmup"]}
    for engine in ENGINES:
        out[engine] = {"decode_tok_s": _spread([row[engine]["decode_tok_s"] for row in rows]),
                       "ttft_warm_ms": _spread([row[engine]["ttft_ms"] for row in rows]),
                       "cpu_ms_per_token": _spread([row[engine]["cpu_ms_per_token"] for row in rows]),
                       "tokens": min(row[engine]["tokens"] for row in rows)}
    out["ours_over_genai"] = {  # within each round: both answers ran seconds apart
        "decode_tok_s": _spread([row["ours"]["decode_tok_s"] / max(1e-9, row["genai"]["decode_tok_s"])
                                 for row in rows]),
        "ttft_warm": _spread([row["ours"]["ttft_ms"] / max(1e-9, row["genai"]["ttft_ms"]) for row in rows]),
        "cpu_ms_per_token": _spread([row["ours"]["cpu_ms_per_token"] / max(1e-9, row["genai"]["cpu_ms_per_token"])
                                     for row in rows]),
    }
    out["per_round"] = rows
    return out


def separate(ir: Path, prompt: str, tokens: int, repeats: int, processes: int,
             report: Callable[[str], None]) -> dict[str, Any]:
    """`processes` fresh children per engine, alternating, and their figures' median and min-max."""
    per: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for i in range(processes):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]  # neither always runs on a cooler machine
        for engine in order:
            r = measure_child(engine, ir, prompt, tokens, repeats)
            per[engine].append(r)
            report(f"  {engine} alone {i + 1}/{processes}: peak anon {r['peak_anon'] / 1e9:.2f} GB, "
                   f"VmHWM {r['vm_hwm'] / 1e9:.2f} GB, "
                   f"TTFT {statistics.median(a['ttft_ms'] for a in r['answers']):.0f} ms, "
                   f"{statistics.median(a['decode_tok_s'] for a in r['answers']):.1f} tok/s")
    out: dict[str, Any] = {}
    for engine, runs in per.items():
        out[engine] = {
            "peak_anon_bytes": _spread([r["peak_anon"] for r in runs]),
            "vm_hwm_bytes": _spread([r["vm_hwm"] for r in runs]),
            "rss_after_load_bytes": _spread([r["after_load"]["VmRSS"] for r in runs]),
            "anon_after_load_bytes": _spread([r["after_load"]["RssAnon"] for r in runs]),
            "anon_after_answers_bytes": _spread([r["after_answers"]["RssAnon"] for r in runs]),
            "load_s": _spread([r["load_s"] for r in runs]),
            # speed with the engine alone in its process (the interleaved figures are the comparison)
            "ttft_warm_ms": _spread([statistics.median(a["ttft_ms"] for a in r["answers"]) for r in runs]),
            "decode_tok_s": _spread([statistics.median(a["decode_tok_s"] for a in r["answers"]) for r in runs]),
            "tokens": min(a["tokens"] for r in runs for a in r["answers"]),
            "per_process": runs,
        }
    return out


def side_by_side(ir: Path, prompt: str, tokens: int, repeats: int, processes: int, rounds: int,
                 report: Callable[[str], None]) -> dict[str, Any]:
    """Speed interleaved in one process (`rounds` rounds), memory in `processes` children per engine."""
    report(f"  speed: both engines in one process, {rounds} interleaved rounds of {tokens} tokens")
    speed = interleaved(ir, prompt, tokens, rounds, report)
    report(f"  memory: a fresh process per engine, x{processes}")
    alone = separate(ir, prompt, tokens, repeats, processes, report)
    ours, genai = alone["ours"], alone["genai"]
    ratio = {
        "decode_tok_s": speed["ours_over_genai"]["decode_tok_s"]["median"],
        "ttft_warm": speed["ours_over_genai"]["ttft_warm"]["median"],
        "cpu_ms_per_token": speed["ours_over_genai"]["cpu_ms_per_token"]["median"],
        "peak_anon": round(ours["peak_anon_bytes"]["median"] / max(1, genai["peak_anon_bytes"]["median"]), 3),
        "vm_hwm": round(ours["vm_hwm_bytes"]["median"] / max(1, genai["vm_hwm_bytes"]["median"]), 3),
    }
    return {
        "ir": ir.name, "ir_bytes": sum(f.stat().st_size for f in ir.glob("*.bin")), "tokens": tokens,
        "interleaved": speed,
        "answers_per_process": repeats, "processes": processes, **alone,
        "ours_vs_genai": ratio,
        "goal": {"decode_at_least_genai": ratio["decode_tok_s"] >= GOAL_DECODE,
                 "ttft_at_most_genai": ratio["ttft_warm"] <= GOAL_TTFT,
                 "peak_anon_within_10pct": ratio["peak_anon"] <= GOAL_MEMORY},
    }


if __name__ == "__main__":
    sys.exit(child_main())

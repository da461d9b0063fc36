"""`flotilla bench local`: what a new user sees first, measured.

- building the demo models into an empty cache (`flotilla models build-demos`);
- `flotilla chat -p …` from launch to its first streamed byte: cold (export to
  OpenVINO IR + compile, empty cache) and warm (everything cached);
- the local engine on each demo model, in this process: decode tok/s and time
  to first token of a greedy answer, after one warm-up request;
- side by side on one IR of a model of real size (--memory-model, default a
  0.90 B random Llama in bf16, 1.8 GB), the local engine against
  openvino_genai.LLMPipeline (engine/bench/_local_memory.py): decode tok/s and
  warm time to first token with both engines in one process, interleaved
  rounds A B / B A (--rounds), ours/genai ratios taken per round; peak
  anonymous RSS and VmHWM in a fresh process per engine (--memory-processes);
  median and min-max of each; `goal` says whether the issue's bar is met
  (decode >= genai, warm TTFT <= genai, peak anon within 10 %).

Everything but the side-by-side model runs against a fresh cache folder of its
own, so the user's cache is neither used nor touched; the side-by-side model
(built deterministically, engine/bench/_checkpoint.py) and its IR are too big
to rebuild per run and live in the user's cache (FLOTILLA_CACHE or the user
cache folder). Repeats are medians; each repeat's figures are kept.
The demo models have random weights: an answer may end at EOS before
--tokens, so the JSON keeps the number of tokens each figure is over.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

NAME = "local"
HELP = "the local engine on the demo models: build time, launch to first byte, decode tok/s, TTFT"

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Tell me a story about the sea"
# Side-by-side answers are at most this long (the 64-token answers): a 0.9 B model
# decodes 10-18 tok/s here, and 34 interleaved + 24 separate answers must fit the ~10 min run.
SIDE_TOKENS_MAX = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="demo,demo-qwen3,demo-moe", help="comma-separated demo ids")
    p.add_argument("--tokens", type=int, default=None, help="new tokens per answer (default 128; quick 64)")
    p.add_argument("--repeats", type=int, default=3, help="measured answers per model, and warm launches")
    p.add_argument("--memory-model", default="random-llama-0.9b",
                   help="side-by-side model: a random-Llama preset (random-llama-0.9b, random-llama-tiny), "
                        "a demo id or a model folder; 'none' skips it")
    p.add_argument("--memory-processes", type=int, default=None,
                   help="fresh child processes per engine for the side-by-side memory (default 3; quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds (one answer per engine each) for the side-by-side speed "
                        "(default 16; quick 3)")
    p.add_argument("--skip-demos", action="store_true",
                   help="only the side-by-side (no demo build, launches or demo-model figures)")


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["FLOTILLA_CACHE"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli.main", *argv]


def time_build(cache: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(_cli("models", "build-demos"), env=_env(cache), check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
    return time.perf_counter() - t0


def time_first_byte(cache: Path, model: str, timeout: float = 600.0) -> float:
    """Seconds from exec of `flotilla chat -p` to the first byte on its stdout."""
    argv = _cli("chat", "--model", model, "-p", PROMPT, "--max-tokens", "8")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(cache), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready or not os.read(proc.stdout.fileno(), 1):
            raise RuntimeError(f"`flotilla chat --model {model}` printed nothing in {timeout:.0f} s")
        first = time.perf_counter() - t0
        proc.stdout.read()
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"`flotilla chat --model {model}` exited with {proc.returncode}")
        return first
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def engine_figures(cache: Path, model: str, tokens: int, repeats: int) -> dict[str, Any]:
    """Decode tok/s and TTFT of greedy answers on the warm local engine (as `flotilla chat` opens it)."""
    from engine.models.ref import resolve_model
    from engine.protocol.messages import GenerateRequest, SamplingParams
    from engine.local.factory import open_whole_model

    old = os.environ.get("FLOTILLA_CACHE")
    os.environ["FLOTILLA_CACHE"] = str(cache)
    try:
        ref = resolve_model(model)
        engine = open_whole_model(Path(ref.path), model)
    finally:
        if old is None:
            os.environ.pop("FLOTILLA_CACHE", None)
        else:
            os.environ["FLOTILLA_CACHE"] = old
    runs: list[dict[str, float]] = []
    try:
        for i in range(repeats + 1):  # the first answer warms up and is not counted
            req = GenerateRequest(f"bench-local-{model}-{i}", prompt=PROMPT,
                                  sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
            final = None
            for ev in engine.stream(engine.submit(req), timeout=600):
                final = ev
            if final is None or final.finish_reason == "error" or final.timings is None or final.usage is None:
                raise RuntimeError(f"{model}: the answer failed: {getattr(final, 'error', None)}")
            if i == 0:
                continue
            runs.append({"decode_tok_s": round(final.timings.decode_tok_s, 2),
                         "ttft_ms": round(final.timings.ttft_s * 1000, 2),
                         "tokens": final.usage.completion_tokens})
    finally:
        engine.close()
    return {
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "tokens": min(r["tokens"] for r in runs),
        "per_repeat": runs,
    }


def memory_figures(spec: str, tokens: int, repeats: int, processes: int, rounds: int,
                   report: Callable[[str], None]) -> dict[str, Any]:
    """The local engine and openvino_genai side by side on the IR of `spec` (user's cache)."""
    from engine.bench._checkpoint import PRESETS, ensure_checkpoint
    from engine.bench._local_memory import side_by_side
    from engine.runtime.ov_backend import ensure_ir

    if spec in PRESETS:
        src = ensure_checkpoint(PRESETS[spec], report=report)
    else:
        from engine.models.ref import resolve_model

        src = Path(resolve_model(spec).path)
    report(f"side by side on {spec}: exporting to OpenVINO once (cached)")
    ir = ensure_ir(src)
    out = side_by_side(ir, PROMPT, tokens, repeats, processes, rounds, report)
    out["model"] = spec
    out["checkpoint_bytes"] = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
    return out


def demo_figures(models: list[str], tokens: int, repeats: int, report: Callable[[str], None]) -> dict[str, Any]:
    """Demo build, launch to first byte and per-model engine figures, in a fresh cache."""
    cache = Path(tempfile.mkdtemp(prefix="flotilla-bench-local-"))
    try:
        report(f"building the demo models into an empty cache ({cache})")
        build_s = time_build(cache)
        report(f"  {build_s:.1f} s")
        first = models[0]
        report(f"launch to first byte, cold ({first}: export + compile)")
        cold = time_first_byte(cache, first)
        warm = []
        for i in range(repeats):
            warm.append(time_first_byte(cache, first))
            report(f"  warm {i + 1}/{repeats}: {warm[-1]:.2f} s")
        per_model = {}
        for m in models:
            report(f"local engine: {m}, {tokens} tokens x {repeats}")
            per_model[m] = engine_figures(cache, m, tokens, repeats)
            report(f"  {per_model[m]['decode_tok_s']:.0f} tok/s, TTFT {per_model[m]['ttft_ms']:.1f} ms")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {
        "build_demos_s": round(build_s, 2),
        "launch_first_byte_s": {"model": first, "cold": round(cold, 2), "warm": round(statistics.median(warm), 2),
                                "warm_per_repeat": [round(w, 2) for w in warm]},
        "engine": per_model,
    }


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    tokens = args.tokens or (64 if quick else 128)
    repeats = max(1, args.repeats)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    demos = None if getattr(args, "skip_demos", False) else demo_figures(models, tokens, repeats, report)
    memory = None
    if args.memory_model.strip().lower() != "none":
        processes = max(1, args.memory_processes or (1 if quick else 3))
        # 16 rounds: one round's ratio swings ±10 % with this machine's load, and the goal
        # (decode >= genai) sits inside that band, so the median needs many rounds to say which side it is on
        rounds = max(1, getattr(args, "rounds", None) or (3 if quick else 16))
        memory = memory_figures(args.memory_model.strip(), min(tokens, SIDE_TOKENS_MAX), repeats, processes,
                                rounds, report)
        ratio, goal = memory["ours_vs_genai"], memory["goal"]
        report(f"  ours / openvino_genai: decode x{ratio['decode_tok_s']}, warm TTFT x{ratio['ttft_warm']}, "
               f"CPU per token x{ratio['cpu_ms_per_token']} (medians of per-round ratios), "
               f"peak anon x{ratio['peak_anon']}, VmHWM x{ratio['vm_hwm']}; "
               f"goal met: {', '.join(k for k, v in goal.items() if v) or 'none'}")
    return {
        "tokens_requested": tokens,
        "repeats": repeats,
        "prompt": PROMPT,
        **(demos or {"build_demos_s": None, "launch_first_byte_s": None, "engine": None}),  # None: --skip-demos
        "side_by_side": memory,  # None with --memory-model none
    }

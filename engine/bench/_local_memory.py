"""Side by side on one IR: the local engine and openvino_genai.LLMPipeline, memory and speed.

Each engine runs in a fresh child process of its own (`python -m
engine.bench._local_memory --engine ours|genai --ir DIR ...`), so peaks are
separate and nothing one engine mapped or cached is counted for the other.
The child loads the engine, answers one warm-up request, then `repeats`
measured ones (greedy, exactly `tokens` new tokens, the same prompt token ids
for both engines), and prints one JSON line. Answer i asks "(i) " + the prompt: openvino_genai
keeps the previous call's KV state and re-uses it when the next prompt starts with the same
tokens (its chat-turn prefix reuse; the local engine has none yet), so a repeated prompt
would time its cache, not its prefill. The parent samples the child's
/proc/PID/status every few ms for the peak anonymous RSS (the kernel keeps a
peak for the whole RSS only, VmHWM, which also counts the IR's mapped file
pages: clean, shared with the page cache, dropped first under pressure).

Figures per child (bytes, seconds, ms):
  load_s                 engine construction (compile; the IR is already exported)
  after_load             RssAnon / RssFile / VmRSS right after loading
  after_answers          the same after every answer (weights are repacked at the first inference)
  peak_anon              the parent's sampled maximum of RssAnon over the child's life
  vm_hwm                 the kernel's peak RSS (anonymous + mapped file pages)
  ttft_ms, decode_tok_s  per measured answer: submit -> first token; (n - 1) / (last - first token)
Both engines are timed the same way, by wall clock around the same call shape.
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


def genai_folder(ir: Path) -> Path:
    """<ir>-genai: the IR's files linked (not copied) plus the tokenizer IRs LLMPipeline needs."""
    import openvino as ov

    out = ir.parent / (ir.name + "-genai")
    if (out / "openvino_detokenizer.xml").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in ir.iterdir():
        link = out / f.name
        if f.is_file() and not link.exists():
            os.symlink(f.resolve(), link)
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(str(ir)), with_detokenizer=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    tmp = out / ".openvino_detokenizer.xml"  # the marker file comes last: a half folder is redone
    ov.save_model(detok, str(tmp))
    tmp.with_suffix(".bin").replace(out / "openvino_detokenizer.bin")
    tmp.replace(out / "openvino_detokenizer.xml")
    return out


# -- the child -------------------------------------------------------------------------------------


def _prompt(prompt: str, i: int) -> str:
    """Answer i's prompt: a different start each time, so no engine re-uses an earlier prefix."""
    return f"({i}) {prompt}"


def _prompt_ids(ir: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    from engine.protocol.messages import ChatMessage
    from engine.runtime.chat import chat_ids

    return chat_ids(AutoTokenizer.from_pretrained(str(ir)), (ChatMessage("user", prompt),))


def _run_ours(ir: Path, prompt: str, tokens: int, answers: int) -> tuple[float, dict, dict, list[dict]]:
    from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams
    from engine.serve.local import LocalEngine

    t = time.perf_counter()
    engine = LocalEngine(ir, "bench")
    load_s = time.perf_counter() - t
    loaded = proc_status()
    runs = []
    try:
        for i in range(answers):
            req = GenerateRequest(f"mem-{i}", messages=(ChatMessage("user", _prompt(prompt, i)),),
                                  sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
            t0 = time.perf_counter()
            stamps: list[float] = []
            final = None
            for ev in engine.stream(engine.submit(req), timeout=900):
                if ev.token_ids:
                    stamps.extend([time.perf_counter()] * len(ev.token_ids))
                final = ev
            if final is None or final.finish_reason == "error":
                raise RuntimeError(f"our engine failed: {getattr(final, 'error', None)}")
            n = final.usage.completion_tokens if final.usage else len(stamps)
            runs.append(_figures(t0, stamps[0] if stamps else time.perf_counter(), time.perf_counter(), n))
        answered = proc_status()
    finally:
        engine.close()
    return load_s, loaded, answered, runs


def _run_genai(ir: Path, prompt: str, tokens: int, answers: int) -> tuple[float, dict, dict, list[dict]]:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    folder = genai_folder(ir)
    prompts = [np.array([_prompt_ids(ir, _prompt(prompt, i))], dtype=np.int64) for i in range(answers)]  # [1, n]
    t = time.perf_counter()
    pipe = ov_genai.LLMPipeline(str(folder), "CPU")  # genai's own defaults
    load_s = time.perf_counter() - t
    loaded = proc_status()
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = tokens
    cfg.do_sample = False

    class Stamps(ov_genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def write(self, token):  # one call per generated token (a list when several come at once)
            self.times.extend([time.perf_counter()] * (len(token) if isinstance(token, list) else 1))
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    runs = []
    for ids in prompts:
        streamer = Stamps()
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        result = pipe.generate(inputs, cfg, streamer=streamer)
        t_end = time.perf_counter()
        n = len(result.tokens[0])
        runs.append(_figures(t0, streamer.times[0] if streamer.times else t_end, t_end, n))
    answered = proc_status()
    del pipe
    return load_s, loaded, answered, runs


def _figures(t0: float, t_first: float, t_end: float, n: int) -> dict[str, float]:
    rate = (n - 1) / (t_end - t_first) if n >= 2 and t_end > t_first else 0.0
    return {"ttft_ms": round((t_first - t0) * 1000, 1), "decode_tok_s": round(rate, 2), "tokens": n}


def child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench._local_memory")
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--ir", type=Path, required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    a = p.parse_args(argv)
    run = _run_ours if a.engine == "ours" else _run_genai
    load_s, loaded, answered, runs = run(a.ir, a.prompt, a.tokens, a.repeats + 1)
    out = {"engine": a.engine, "load_s": round(load_s, 2), "after_load": loaded,
           "after_answers": answered, "warmup": runs[0], "answers": runs[1:]}
    print("FLOTILLA-MEM " + json.dumps(out), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------------------


def measure_child(engine: str, ir: Path, prompt: str, tokens: int, repeats: int,
                  timeout: float = 1800.0) -> dict[str, Any]:
    """One fresh child process running `engine`; its JSON plus the sampled peak RssAnon."""
    from engine.bench.local import _env  # the same environment as the bench's other children

    env = _env(Path(os.environ.get("FLOTILLA_CACHE") or _default_cache()))
    argv = [sys.executable, "-m", "engine.bench._local_memory", "--engine", engine, "--ir", str(ir),
            "--prompt", prompt, "--tokens", str(tokens), "--repeats", str(repeats)]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = {"anon": 0}

    def sample() -> None:
        while proc.poll() is None:
            try:
                peak["anon"] = max(peak["anon"], proc_status(proc.pid).get("RssAnon", 0))
            except (OSError, ValueError):
                return
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sampler.join(1.0)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("FLOTILLA-MEM ")), None)
    if proc.returncode != 0 or line is None:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{engine} child exited with {proc.returncode}: {tail}")
    out = json.loads(line[len("FLOTILLA-MEM "):])
    out["peak_anon"] = peak["anon"]
    out["vm_hwm"] = out["after_answers"].get("VmHWM", 0)
    return out


def _default_cache() -> str:
    from engine.models.demo import cache_root

    return str(cache_root())


def _spread(values: list[float]) -> dict[str, float]:
    """Median and min-max of one figure over the child processes."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def side_by_side(ir: Path, prompt: str, tokens: int, repeats: int, processes: int,
                 report: Callable[[str], None]) -> dict[str, Any]:
    """`processes` fresh children per engine, alternating, and their figures' median and min-max."""
    per: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for i in range(processes):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]  # neither always runs on a cooler machine
        for engine in order:
            r = measure_child(engine, ir, prompt, tokens, repeats)
            per[engine].append(r)
            report(f"  {engine} {i + 1}/{processes}: peak anon {r['peak_anon'] / 1e9:.2f} GB, "
                   f"TTFT {statistics.median(a['ttft_ms'] for a in r['answers']):.0f} ms, "
                   f"{statistics.median(a['decode_tok_s'] for a in r['answers']):.1f} tok/s")
    out: dict[str, Any] = {"ir": ir.name, "ir_bytes": sum(f.stat().st_size for f in ir.glob("*.bin")),
                           "tokens": tokens, "answers_per_process": repeats, "processes": processes}
    for engine, runs in per.items():
        out[engine] = {
            "peak_anon_bytes": _spread([r["peak_anon"] for r in runs]),
            "vm_hwm_bytes": _spread([r["vm_hwm"] for r in runs]),
            "rss_after_load_bytes": _spread([r["after_load"]["VmRSS"] for r in runs]),
            "anon_after_load_bytes": _spread([r["after_load"]["RssAnon"] for r in runs]),
            "anon_after_answers_bytes": _spread([r["after_answers"]["RssAnon"] for r in runs]),
            "load_s": _spread([r["load_s"] for r in runs]),
            "ttft_warm_ms": _spread([statistics.median(a["ttft_ms"] for a in r["answers"]) for r in runs]),
            "decode_tok_s": _spread([statistics.median(a["decode_tok_s"] for a in r["answers"]) for r in runs]),
            "tokens": min(a["tokens"] for r in runs for a in r["answers"]),
            "per_process": runs,
        }
    ours, genai = out["ours"], out["genai"]
    out["ours_vs_genai"] = {
        "peak_anon": round(ours["peak_anon_bytes"]["median"] / max(1, genai["peak_anon_bytes"]["median"]), 3),
        "decode_tok_s": round(ours["decode_tok_s"]["median"] / max(1e-9, genai["decode_tok_s"]["median"]), 3),
        "ttft_warm": round(ours["ttft_warm_ms"]["median"] / max(1e-9, genai["ttft_warm_ms"]["median"]), 3),
    }
    return out


if __name__ == "__main__":
    sys.exit(child_main())

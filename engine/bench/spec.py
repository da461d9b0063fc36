"""`flotilla bench spec`: speculative decoding with mask-based KV rollback.

Target: a compute-bound random-weight Llama (engine.bench.shards.dense_recipe,
hidden 1024, 8 layers) whose layers 1..7 are damped (their residual updates
scaled by --damp; engine.speculative.synthetic.damped_target), so that a cheap
layer-skip draft -- the target's embedding, first layer and head, with
Gaussian noise added to its weights -- predicts it well. The noise level is
calibrated (teacher-forced, torch) to per-token acceptance rates of about
50 / 70 / 90 %. A decode step costs the same as the undamped model's.

Figures:
  rollback    the whole target as one shard (ShardRunner, in-process) at
              contexts 256/1024/4096: decode_step_ms (1 token), the mask
              rollback (hide the 4 rejected drafts of a K=4 step and build the
              next feed), the physical trim (query_state -> slice -> set
              state), and a decode step with 4 hidden positions vs none.
  throughput  a 2-stage pipeline (worker processes, f32 exact) with the
              draft on the coordinator: tok/s of one stream without
              speculation and with K=4 at each acceptance level (and prompt
              lookup), alternating, medians over repeats; speedup_at_70pct.
              Also 2 interleaved streams at the 70 % draft.
  identical_to_greedy  every speculative answer equals the plain greedy one
              (of every run: synthetic, real_pair and real_lookup).
  genai       openvino_genai's own speculative LLMPipeline on the same target
              and 70 % draft (optimum IR + openvino_tokenizers), as an anchor.
  pair        says that the figures above come from a synthetic pair
              ("synthetic": true): the acceptance is set by construction.

A real pair, for contrast (same 2-stage pipeline, f32, greedy, fixed K):
  real_pair   the demo models: demo-draft drafting for demo (--pair-draft,
              --pair-target). Separately initialised random weights sharing
              a tokenizer, so acceptance is whatever it is (low): measured
              acceptance, tok/s without and with speculation, speedup,
              identical_to_greedy.
  real_lookup prompt lookup on the same real target with a repetitive,
              code-like prompt (LOOKUP_PROMPT): the same figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

NAME = "spec"
HELP = "speculative decoding: mask vs trim rollback, tok/s at controlled acceptance, openvino_genai anchor"

PROMPT = "Once upon a time there was a small robot who lived by the sea and"
# Repetitive, code-like: what prompt lookup is for (it drafts n-grams seen earlier in the context).
LOOKUP_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                 "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n\n\n"
                 "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024, help="target hidden size (default 1024)")
    p.add_argument("--layers", type=int, default=8, help="target layers (default 8)")
    p.add_argument("--damp", type=float, default=0.02, help="residual scale of target layers >= 1 (default 0.02)")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per step (default 4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per answer (default 48 quick, 128 full)")
    p.add_argument("--repeats", type=int, default=None, help="repeats (default 3 quick, 5 full)")
    p.add_argument("--contexts", default="256,1024,4096", help="rollback contexts (default 256,1024,4096)")
    p.add_argument("--threads", type=int, default=1, help="OpenVINO threads per stage (default 1)")
    p.add_argument("--targets", default="0.5,0.7,0.9", help="acceptance levels (default 0.5,0.7,0.9)")
    p.add_argument("--heads", type=int, default=16, help="target attention heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="target KV heads (default 4)")
    p.add_argument("--no-genai", action="store_true", help="skip the openvino_genai anchor")
    p.add_argument("--pair-target", default="demo", help="target of the real pair run (default demo)")
    p.add_argument("--pair-draft", default="demo-draft", help="draft of the real pair run (default demo-draft)")
    p.add_argument("--no-real", action="store_true", help="skip the real pair and prompt-lookup runs")


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else 0.0


# -- rollback costs ---------------------------------------------------------------------------------
def rollback_figures(path: Path, layers: int, contexts: list[int], threads: int, repeats: int,
                     report: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from engine.shards.export import ensure_shard
    from engine.shards.runtime import ShardRunner
    from engine.runtime.kv_state import VisibleMask, state_bytes, trim_state

    info = ensure_shard(path, 0, layers, num_layers_total=layers)
    runner = ShardRunner(info, config={"INFERENCE_NUM_THREADS": threads} if threads else None)
    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for ctx in contexts:
        st = runner.new_stream()
        mask = VisibleMask(ctx + 64)
        ids = rng.integers(10, 1000, size=ctx)
        for s in range(0, ctx, 512):  # prefill
            part = ids[s:s + 512][None].astype(np.int64)
            st.run({"input_ids": part, "attention_mask": mask.feed(part.shape[1]),
                    "position_ids": mask.positions(part.shape[1])})
            mask.commit(part.shape[1])

        def step(n: int) -> float:
            x = rng.integers(10, 1000, size=(1, n)).astype(np.int64)
            t = time.perf_counter()
            st.run({"input_ids": x, "attention_mask": mask.feed(n), "position_ids": mask.positions(n)})
            ms = (time.perf_counter() - t) * 1000.0
            mask.commit(n)
            return ms

        decode, hidden_decode, verify, mask_ms, trim_ms = [], [], [], [], []
        for _ in range(repeats * 3):
            decode.append(step(1))
            verify.append(step(5))  # pending + 4 drafts, 4 rejected
            t = time.perf_counter()
            mask.hide_tail(4)  # mask rollback: hide them ...
            mask.feed(1), mask.positions(1)  # ... and build the next step's mask and positions
            mask_ms.append((time.perf_counter() - t) * 1000.0)
            hidden_decode.append(step(1))  # a decode step over the hidden positions
        kv_mib = state_bytes(st.request) / 2**20
        for _ in range(repeats * 2):  # physical trim of 4 rejected positions (fresh state each time)
            step(5)
            keep = mask.length - 4
            t = time.perf_counter()
            trim_state(st.request, keep)
            trim_ms.append((time.perf_counter() - t) * 1000.0)
            mask.length = keep  # (no hidden positions in the tail: just forget them)
        d = _median(decode)
        out[str(ctx)] = {
            "decode_step_ms": d, "verify_step_ms_k4": _median(verify),
            "mask_rollback_ms": _median(mask_ms), "trim_rollback_ms": _median(trim_ms),
            "decode_step_with_hidden_ms": _median(hidden_decode), "kv_mib": round(kv_mib, 2),
            "mask_over_decode_pct": round(100 * _median(mask_ms) / d, 4) if d else None,
            "trim_over_decode_pct": round(100 * _median(trim_ms) / d, 2) if d else None,
            "trim_ms_per_mib": round(_median(trim_ms) / kv_mib, 4) if kv_mib else None,
        }
        report(f"context {ctx}: {out[str(ctx)]}")
    return out


# -- the draft: calibrated noise on a layer-skip copy -------------------------------------------------
def calibrate(target: Path, targets: list[float], report: Callable[[str], None]) -> list[dict[str, Any]]:
    """Noise sigma per acceptance level, by bisection on teacher-forced agreement (torch)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.speculative.synthetic import noisy_draft

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    x = torch.tensor([[5, 17, 300, 42, 7, 99, 1000, 3]])
    with torch.no_grad():
        seq = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=96, do_sample=False)
        want = model(seq).logits[0, x.shape[1] - 1:].argmax(-1)
    del model

    def agreement(sigma: float) -> float:
        path = noisy_draft(target, sigma, layers=1)
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            got = m(seq).logits[0, x.shape[1] - 1:].argmax(-1)
        return float((got == want).float().mean())

    out = []
    for level in targets:
        lo, hi = 0.0, 0.5
        best = (1.0, 0.0, agreement(0.0))
        for _ in range(7):
            mid = (lo + hi) / 2
            a = agreement(mid)
            if abs(a - level) < abs(best[2] - level):
                best = (abs(a - level), mid, a)
            if a > level:
                lo = mid
            else:
                hi = mid
        out.append({"target_acceptance": level, "sigma": round(best[1], 5),
                    "teacher_forced_acceptance": round(best[2], 3),
                    "path": str(noisy_draft(target, round(best[1], 5), layers=1))})
        report(f"draft for {level:.0%}: sigma {best[1]:.4f} -> {best[2]:.1%} (teacher-forced)")
    return out


# -- throughput over 2 stages --------------------------------------------------------------------------
def _answer(engine, rid: str, n: int, spec, streams: int = 1,
            prompt: str = PROMPT) -> tuple[list[list[int]], float]:
    from engine.protocol.messages import GenerateRequest, SamplingParams

    t = time.perf_counter()
    ids = [engine.submit(GenerateRequest(f"{rid}-{i}", prompt=prompt + " " * i, speculative=spec,
                                         sampling=SamplingParams(max_tokens=n, ignore_eos=True))) for i in range(streams)]
    out = []
    for r in ids:
        events = list(engine.stream(r, timeout=600))
        if events[-1].finish_reason == "error":
            raise RuntimeError(events[-1].error)
        out.append([tok for e in events for tok in e.token_ids])
    return out, time.perf_counter() - t


def throughput(target: Path, drafts: list[dict[str, Any]], k: int, tokens: int, repeats: int, threads: int,
               report: Callable[[str], None]) -> dict[str, Any]:
    from engine.pipeline.runner import FleetConfig, launch_pipeline
    from engine.pipeline.speculative import RingSpeculation
    from engine.protocol.messages import SpeculativeParams
    from engine.speculative.config import SpecConfig

    eng = launch_pipeline(FleetConfig(model=str(target), stages=2, exact=True, threads=threads))
    specs = {}
    for d in drafts:
        specs[f"draft{round(d['target_acceptance'] * 100)}"] = RingSpeculation(
            SpecConfig(draft_model=d["path"]), eng.model_id, eng.vocab_size, "CPU", "f32")
        specs[f"draft{round(d['target_acceptance'] * 100)}"]._draft_model()
    specs["lookup"] = RingSpeculation(SpecConfig(), eng.model_id, eng.vocab_size)
    plain = eng.spec
    times: dict[str, list[float]] = {"off": [], **{name: [] for name in specs}}
    times2: dict[str, list[float]] = {"off": [], "draft70": []}
    identical = True
    base = None
    stats: dict[str, dict] = {}
    try:
        _answer(eng, "warm", 8, None)
        for r in range(repeats):
            eng.spec = plain
            got, s = _answer(eng, f"off{r}", tokens, None)
            times["off"].append(s)
            base = base or got[0]
            identical &= got[0] == base
            for name, ring in specs.items():
                eng.spec = ring
                mode = "lookup" if name == "lookup" else "draft"
                got, s = _answer(eng, f"{name}{r}", tokens, SpeculativeParams(mode, k, adaptive=False))
                times[name].append(s)
                identical &= got[0] == base
            if "draft70" in specs:  # 2 interleaved streams
                eng.spec = plain
                _got2, s = _answer(eng, f"off2-{r}", tokens, None, streams=2)
                times2["off"].append(s)
                eng.spec = specs["draft70"]
                got2, s = _answer(eng, f"d2-{r}", tokens, SpeculativeParams("draft", k, adaptive=False), streams=2)
                times2["draft70"].append(s)
                identical &= got2[0] == base
            report(f"repeat {r}: " + ", ".join(f"{n} {len(base) / t[-1]:.1f} tok/s" for n, t in times.items()))
        eng.spec = specs.get("draft70", plain)  # adaptive K, one run, for the record
        got, s = _answer(eng, "adaptive", tokens, SpeculativeParams("draft", k))
        identical &= got[0] == base
        adaptive_tok_s = len(base) / s
        for name, ring in specs.items():
            t = ring.totals
            trials = t["accepted"] + t["rejections"]
            stats[name] = {"acceptance": round(t["accepted"] / trials, 3) if trials else 0.0,
                           "tokens_per_step": round((t["accepted"] + t["steps"]) / t["steps"], 3)
                           if t["steps"] else 0.0, "compactions": t["compactions"]}
    finally:
        eng.spec = plain
        for ring in specs.values():
            ring.close()
        eng.close()
    n = len(base or [])
    tok_s = {name: round(n / _median(t), 2) for name, t in times.items()}
    res: dict[str, Any] = {
        "tokens": n, "k": k, "stages": 2, "streams": 1,
        "tok_s": tok_s,
        "speedup": {name: round(tok_s[name] / tok_s["off"], 3) for name in specs},
        "measured": stats,
        "adaptive_k_tok_s_at_70pct": round(adaptive_tok_s, 2),
        "identical": identical,
    }
    if times2["off"]:
        off2, d2 = 2 * n / _median(times2["off"]), 2 * n / _median(times2["draft70"])
        res["two_streams_tok_s"] = {"off": round(off2, 2), "draft70": round(d2, 2),
                                    "speedup": round(d2 / off2, 3)}
    return res


# -- a real pair: the demo models ------------------------------------------------------------------------
def _spec_stats(totals: dict[str, int]) -> dict[str, Any]:
    """Acceptance figures from a RingSpeculation's totals. `acceptance` is the
    per-token rate of throughput.measured (accepted / (accepted + steps that
    ended on a rejection), what adaptive K models); `accepted_of_drafted` is
    the plain share of drafted tokens the target kept."""
    proposed, accepted = totals.get("proposed", 0), totals.get("accepted", 0)
    rejections, steps = totals.get("rejections", 0), totals.get("steps", 0)
    trials = accepted + rejections
    return {"acceptance": round(accepted / trials, 3) if trials else 0.0,
            "accepted_of_drafted": round(accepted / proposed, 3) if proposed else 0.0,
            "drafted": proposed, "accepted": accepted, "verify_steps": steps,
            "tokens_per_step": round((accepted + steps) / steps, 3) if steps else 0.0}


def _describe(spec: str) -> str:
    from engine.models.demo import RECIPES

    r = RECIPES.get(spec)
    return f"{spec} ({r.description})" if r is not None else spec


def real_pair(target_spec: str, draft_spec: str, k: int, tokens: int, repeats: int, threads: int,
              report: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(real_pair, real_lookup): a real draft model and prompt lookup on a real target,
    2 stages, f32, greedy, fixed K; cases alternate, medians of per-run tok/s."""
    from engine.models import resolve_model
    from engine.pipeline.runner import FleetConfig, launch_pipeline
    from engine.pipeline.speculative import RingSpeculation
    from engine.protocol.messages import SpeculativeParams
    from engine.speculative.config import SpecConfig

    eng = launch_pipeline(FleetConfig(model=target_spec, stages=2, exact=True, threads=threads))
    rings: list[Any] = []
    try:
        draft = RingSpeculation(SpecConfig(draft_model=draft_spec), eng.model_id, eng.vocab_size, "CPU", "f32")
        rings.append(draft)
        draft._draft_model()  # resolved (built if missing) and compiled before any timing
        draft_path = str(resolve_model(draft_spec).path)
        lookup = RingSpeculation(SpecConfig(), eng.model_id, eng.vocab_size)
        rings.append(lookup)
        plain = eng.spec
        cases = {"off": (plain, None, PROMPT), "draft": (draft, "draft", PROMPT),
                 "lookup_off": (plain, None, LOOKUP_PROMPT), "lookup": (lookup, "lookup", LOOKUP_PROMPT)}
        rates: dict[str, list[float]] = {name: [] for name in cases}
        answers: dict[str, list[list[int]]] = {name: [] for name in cases}
        _answer(eng, "real-warm", 8, None)
        for r in range(repeats):
            for name, (ring, mode, prompt) in cases.items():
                eng.spec = ring
                params = SpeculativeParams(mode, k, adaptive=False) if mode else None
                got, sec = _answer(eng, f"real-{name}{r}", tokens, params, prompt=prompt)
                answers[name].append(got[0])
                rates[name].append(len(got[0]) / sec if sec > 0 else 0.0)
            report(f"real pair, repeat {r}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in rates.items()))
        eng.spec = plain
        draft_stats, lookup_stats = _spec_stats(draft.totals), _spec_stats(lookup.totals)
    finally:
        for ring in rings:
            ring.close()
        eng.close()

    def figures(off: str, on: str, stats: dict[str, Any]) -> dict[str, Any]:
        tok_s = {"off": _median(rates[off]), on: _median(rates[on])}
        tok_s = {n: round(v, 2) for n, v in tok_s.items()}
        base = answers[off][0]
        return {"k": k, "adaptive": False, "stages": 2, "streams": 1, "repeats": repeats, "max_tokens": tokens,
                "tokens": len(base), **stats, "tok_s": tok_s,
                "speedup": round(tok_s[on] / tok_s["off"], 3) if tok_s["off"] else None,
                "identical_to_greedy": all(a == base for a in answers[off] + answers[on])}

    pair = figures("off", "draft", draft_stats)
    pair = {"pair": {"synthetic": False, "target": target_spec, "draft": draft_spec, "draft_path": draft_path,
                     "description": f"real pair: {_describe(draft_spec)} drafting for {_describe(target_spec)}; "
                                    "two separate models sharing a tokenizer, nothing tuned for agreement"},
            "prompt": PROMPT, **pair}
    look = {"target": target_spec, "prompt": LOOKUP_PROMPT,
            "description": "prompt lookup (n-grams of the context, no draft model) on the real target, "
                           "repetitive code-like prompt", **figures("lookup_off", "lookup", lookup_stats)}
    report(f"real pair: acceptance {pair['acceptance']}, speedup {pair['speedup']}; "
           f"prompt lookup: acceptance {look['acceptance']}, speedup {look['speedup']}")
    return pair, look


# -- openvino_genai anchor ---------------------------------------------------------------------------------
def genai_anchor(target: Path, draft: Path, k: int, tokens: int, repeats: int,
                 report: Callable[[str], None]) -> dict[str, Any]:
    try:
        import shutil

        import openvino as ov
        import openvino_genai as ov_genai
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        from engine.runtime.ov_backend import ensure_ir

        def genai_dir(src: Path) -> Path:
            ir = ensure_ir(src)
            out = ir.parent / (ir.name + "-genai")
            if not (out / "openvino_detokenizer.xml").exists():
                out.mkdir(parents=True, exist_ok=True)
                for f in ir.iterdir():
                    if f.is_file():
                        shutil.copy2(f, out / f.name)
                tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(str(src)), with_detokenizer=True)
                ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
                ov.save_model(detok, str(out / "openvino_detokenizer.xml"))
            return out

        t_dir, d_dir = genai_dir(target), genai_dir(draft)
        cfg = {"INFERENCE_PRECISION_HINT": "f32"}
        plain = ov_genai.LLMPipeline(str(t_dir), "CPU", **cfg)
        spec = ov_genai.LLMPipeline(str(t_dir), "CPU", draft_model=ov_genai.draft_model(str(d_dir), "CPU", **cfg),
                                    **cfg)
        g = ov_genai.GenerationConfig()
        g.max_new_tokens, g.min_new_tokens, g.do_sample = tokens, tokens, False
        gs = ov_genai.GenerationConfig()
        gs.max_new_tokens, gs.min_new_tokens, gs.do_sample, gs.num_assistant_tokens = tokens, tokens, False, k
        tp, ts, same = [], [], True
        for pipe, conf in ((plain, g), (spec, gs)):
            pipe.generate(PROMPT, conf)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter(); a = plain.generate(PROMPT, g); tp.append(time.perf_counter() - t)
            t = time.perf_counter(); b = spec.generate(PROMPT, gs); ts.append(time.perf_counter() - t)
            same &= str(a) == str(b)
        res = {"supported": True, "k": k, "tokens": tokens, "tok_s_plain": round(tokens / _median(tp), 2),
               "tok_s_speculative": round(tokens / _median(ts), 2),
               "speedup": round(_median(tp) / _median(ts), 3), "identical_text": same,
               "note": "whole model in one process (no pipeline), f32, same target and 70% draft"}
        report(f"openvino_genai: {res}")
        return res
    except Exception as e:  # report why, do not fail the benchmark
        msg = " ".join(str(e).split())[:400] or type(e).__name__
        report(f"openvino_genai anchor failed: {msg}")
        return {"supported": False, "reason": f"{type(e).__name__}: {msg}"}


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench.shards import dense_recipe
    from engine.models.demo import ensure_recipe
    from engine.speculative.config import COMPACT_FRACTION
    from engine.speculative.synthetic import damped_target

    tokens = args.tokens or (48 if args.quick else 128)
    repeats = args.repeats or (3 if args.quick else 5)
    contexts = [int(c) for c in args.contexts.split(",")]
    levels = [float(x) for x in args.targets.split(",")]
    recipe = dense_recipe(args.hidden, args.layers, heads=getattr(args, "heads", 16),
                          kv_heads=getattr(args, "kv_heads", 4))
    report(f"building {recipe.demo_id} (first run only)")
    target = damped_target(ensure_recipe(recipe), 1, args.damp)

    report("rollback costs (whole target, one shard)")
    roll = rollback_figures(target, args.layers, contexts, args.threads, repeats, report)
    report("calibrating drafts")
    drafts = calibrate(target, levels, report)
    report("throughput over 2 stages")
    thr = throughput(target, drafts, args.k, tokens, repeats, args.threads, report)
    d70 = next((d for d in drafts if abs(d["target_acceptance"] - 0.7) < 1e-6), drafts[len(drafts) // 2])
    genai = ({"supported": False, "reason": "skipped (--no-genai)"} if args.no_genai else
             genai_anchor(target, Path(d70["path"]), args.k, tokens, repeats, report))
    if getattr(args, "no_real", False):
        real = look = {"skipped": True, "reason": "--no-real"}
    else:
        report(f"real pair: {args.pair_draft} -> {args.pair_target}, and prompt lookup, over 2 stages")
        real, look = real_pair(args.pair_target, args.pair_draft, args.k, tokens, repeats, args.threads, report)
    first = roll[str(contexts[0])]
    damped = "layer 1 is" if args.layers == 2 else f"layers 1..{args.layers - 1} are"
    return {
        "pair": {"synthetic": True, "target": str(target), "draft": "noisy layer-skip copy of the target (drafts)",
                 "description": f"synthetic pair: a random-weight Llama (hidden {args.hidden}, {args.layers} "
                                f"layers) whose {damped} damped x{args.damp:g} (effectively one layer), "
                                "drafted by its own embedding + layer 0 + head with calibrated weight noise: "
                                "acceptance is set by construction, not measured on a real model pair "
                                "(see real_pair)"},
        "model": {"hidden": args.hidden, "layers": args.layers, "damp": args.damp, "draft_layers": 1,
                  "path": str(target)},
        "decode_step_ms": {c: v["decode_step_ms"] for c, v in roll.items()},
        "mask_rollback_ms": {c: v["mask_rollback_ms"] for c, v in roll.items()},
        "trim_rollback_ms": {c: v["trim_rollback_ms"] for c, v in roll.items()},
        "rollback": roll,
        "mask_rollback_under_1pct": all(v["mask_over_decode_pct"] < 1.0 for v in roll.values()),
        "compact_fraction": COMPACT_FRACTION,
        "drafts": drafts,
        "throughput": thr,
        "speedup_at_70pct": thr["speedup"].get("draft70"),
        # every speculative answer of every run (synthetic, real pair, prompt lookup) equals plain greedy
        "identical_to_greedy": thr["identical"] and all(r.get("identical_to_greedy", True) for r in (real, look)),
        "openvino_genai": genai,
        "decode_step_ms_at_256": first["decode_step_ms"],
        "real_pair": real,
        "real_lookup": look,
    }

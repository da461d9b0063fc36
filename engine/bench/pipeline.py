"""`flotilla bench pipeline`: request interleaving over 2 stage processes vs one monolithic model
and vs 2 data-parallel replicas of it.

A compute-bound random-weight Llama (engine.bench.shards.dense_recipe) runs
  monolithic  the whole model ([0, L) shard, fused stateful KV) in ONE child
              process pinned to one core (taskset), driven directly through
              ShardRunner: N streams round-robin, no messaging at all;
  pipeline    2 stage worker processes (engine.shards.worker, the shards
              [0, L/2) and [L/2, L)), each pinned to its own core, driven by
              the PipelineEngine coordinator (engine.pipeline.coordinator)
              running in another child process, pinned (see below);
  monolithic_engine  the whole model as ONE stage worker on the first core
              behind the same coordinator (what the ring machinery costs);
  data_parallel  2 replicas of the whole model (monolithic children), one per
              stage core, each serving half the streams at once (_replicas.py);
with 1, 2 and 4 streams: N greedy requests submitted at once, each generating
--tokens tokens after a short prompt; aggregate tok/s = all generated tokens /
wall time from submit to the last token (prefill included, the same in both).
Every OpenVINO model gets INFERENCE_NUM_THREADS=1, so a process uses one core.
Cases alternate inside each repeat (monolithic and pipeline processes stay
loaded and idle between cases); figures are medians over repeats.

speedup_2streams = speedup_vs_monolithic = pipeline with 2 streams / monolithic
with 1 stream (goal >= 1.85; the paper reached 1.80x on two Arc iGPU nodes);
pipeline_over_data_parallel = pipeline / data_parallel at the same stream count
(headline at 2 streams). `pinning` records the cores every process ran on, and
`pinning_note` why that is fair (engine/bench/_replicas.py).

The full run (not --quick) adds network profiles: every process (coordinator,
stage 0, stage 1) runs in its own network namespace created by the benchmark
(engine/bench/_netns.py), joined by veth pairs to a bridge in a namespace of
its own. Each hop between two nodes costs a one-way delay D: this kernel has no
sch_netem, so D comes from a delaying TCP relay in front of every node's
sockets (bytes in both directions released D ms after they arrived, in order),
and the rate limit from a tbf qdisc on every node's eth0. Profiles: "wifi"
(D = 2.5 ms, i.e. 5 ms RTT, 300 Mbit/s) and "wan100" (D = 100 ms per hop).
For each, the pipeline's aggregate tok/s with 1, 2, 4 streams and the
interleaving gain (N streams / 1 stream) are reported.
"""

from __future__ import annotations

import argparse
import os
import signal
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from engine.bench._pipeline_child import Child
from engine.bench._replicas import Replicas, pinned_process, pinning_record, plan_pinning, ratios, taskset_prefix

NAME = "pipeline"
HELP = "pipeline request interleaving: 2 pinned stage processes vs the monolithic model on one core"

PROMPTS = ["Once upon a time", "The robot walked into", "Tell me about the sea", "A small cat",
           "In the morning the", "She opened the door and", "Why is the sky", "The old man said"]
PROFILES = {  # name -> one-way delay per hop (ms), rate limit (Mbit/s) or None
    "wifi": (2.5, 300.0),
    "wan100": (100.0, None),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--inter", type=int, default=None, help="FFN width (default 2.75 x hidden)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=4, help="K/V heads (default 4)")
    p.add_argument("--streams", default="1,2,4", help="comma-separated stream counts (default 1,2,4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per stream (default 24 quick, 64 full)")
    p.add_argument("--repeats", type=int, default=None, help="repeats (default 3 quick, 5 full)")
    p.add_argument("--cores", default="0,1", help="cores of stage 0 and stage 1; the monolithic run uses the first")
    p.add_argument("--threads", type=int, default=1, help="INFERENCE_NUM_THREADS per process (default 1)")
    p.add_argument("--coordinator", choices=("auto", "own", "shared"), default="auto",
                   help="coordinator cores: own = a spare core, shared = its stages' cores "
                        "(default auto: own when there is a spare core)")
    p.add_argument("--profiles", default=None,
                   help=f"network profiles for the full run (default: {','.join(PROFILES)}; 'none' skips)")
    p.add_argument("--net-tokens", type=int, default=None, help="tokens per stream under a network profile "
                                                                "(default 8 for wan100, else --tokens)")


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="flotilla-bench-pipeline-"))  # the workers' logs
    try:
        out = _measure(args, report, logs)
    except BaseException:
        if any(logs.iterdir()):
            report(f"the workers' logs are kept in {logs}")
        else:
            logs.rmdir()
        raise
    shutil.rmtree(logs, ignore_errors=True)  # a finished run: nothing there anyone needs
    return out


def _measure(args: argparse.Namespace, report: Callable[[str], None], logs: Path) -> dict[str, Any]:
    from engine.bench.shards import dense_recipe, model_summary
    from engine.pipeline.runner import even_split
    from engine.models.demo import cache_root, ensure_recipe
    from engine.shards.export import ensure_shard

    quick = bool(args.quick)
    tokens = args.tokens or (24 if quick else 64)
    repeats = args.repeats or (3 if quick else 5)
    streams = [int(s) for s in str(args.streams).split(",") if s.strip()]
    cores = [int(c) for c in str(args.cores).split(",") if c.strip()]
    if len(cores) < 2:
        raise SystemExit("--cores needs two cores (stage 0, stage 1)")
    allowed = os.sched_getaffinity(0)
    if not set(cores[:2]) <= allowed or cores[0] == cores[1]:
        raise SystemExit(f"cores {cores[:2]} are not 2 distinct cores available here (allowed: {sorted(allowed)})")
    # Every process gets its own share of cores, the coordinators included (why: engine/bench/_replicas.py).
    pin = plan_pinning(cores[:2], allowed, getattr(args, "coordinator", "auto"))
    profiles_arg = args.profiles if args.profiles is not None else ("none" if quick else ",".join(PROFILES))
    profiles = [] if profiles_arg == "none" else [p for p in profiles_arg.split(",") if p.strip()]
    for p in profiles:
        if p not in PROFILES:
            raise SystemExit(f"unknown profile {p!r}; known: {', '.join(PROFILES)}")

    recipe = dense_recipe(args.hidden, args.layers, args.inter, args.heads, args.kv_heads)
    report(f"building {recipe.demo_id} (first run only)")
    path = ensure_recipe(recipe)
    model = model_summary(path, recipe)
    layers = model["layers"]
    report(f"model: {model['params_m']} M params, {model['f32_weights_mb']} MB f32")
    ranges = list(even_split(layers, 2))
    infos = {}
    for s, e in [(0, layers), *ranges]:
        infos[(s, e)] = ensure_shard(path, s, e, num_layers_total=layers)

    from transformers import AutoTokenizer

    from engine.runtime.chat import prompt_ids

    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [prompt_ids(tok, p) for p in PROMPTS]
    blobs = str(cache_root() / "ov-blobs")
    common = {"model_path": str(path), "model_id": recipe.demo_id, "threads": args.threads,
              "blobs": blobs, "log_dir": str(logs)}
    load = {"before": os.getloadavg()}

    mono_spec = {**common, "cmd": "setup_mono", "shard": infos[(0, layers)].path}
    ring_spec = {**common, "cmd": "setup_ring", "shards": [infos[r].path for r in ranges],
                 "ranges": ranges, "cores": cores[:2], "max_concurrent": max(streams),
                 "stage_prefix": [[], []], "host": "127.0.0.1", "coord_host": "127.0.0.1", "relays": None,
                 "coord_cores": pin["coordinator"]}
    # The whole model as ONE stage worker on the first core, behind the same coordinator:
    # separates what the ring costs from what interleaving gains.
    one_spec = {**ring_spec, "shards": [infos[(0, layers)].path], "ranges": [(0, layers)],
                "cores": cores[:1], "stage_prefix": [[]]}
    report(f"starting the monolithic processes (cores {cores[:2]}), a 1-stage ring (core {cores[0]}) "
           f"and 2 stage processes (cores {cores[:2]}); coordinators on {pin['coordinator']}")
    children: list[Child] = []
    cells: dict[tuple[str, int], list[float]] = {}
    with pinned_process(pin["coordinator"]) as bench_cores:  # restored on the way out
        try:
            children.append(mono := Child(taskset_prefix([cores[0]]), mono_spec, logs / "mono.log"))
            # the second data-parallel replica (the first is `mono`)
            children.append(mono_b := Child(taskset_prefix([cores[1]]), mono_spec, logs / "mono-1.log"))
            children.append(one := Child(taskset_prefix(pin["coordinator_1stage"]), one_spec, logs / "ring1.log"))
            children.append(ring := Child(taskset_prefix(pin["coordinator"]), ring_spec, logs / "ring.log"))
            cases = [("monolithic", mono), ("monolithic_engine", one), ("pipeline_2stages", ring),
                     ("data_parallel", Replicas([mono, mono_b]))]
            ids_for = {"monolithic", "data_parallel"}  # driven through ShardRunner: token ids, not text
            # Warm-up: one short run of each (first inferences allocate and page in).
            for name, child in cases:
                child.ask({"cmd": "run", "streams": 2, "tokens": 4,
                           "prompts": prompts if name in ids_for else PROMPTS})
            for rep in range(repeats):
                for n in streams:
                    k = rep % len(cases)
                    for name, child in cases[k:] + cases[:k]:  # rotate who goes first
                        res = child.ask({"cmd": "run", "streams": n, "tokens": tokens,
                                         "prompts": prompts if name in ids_for else PROMPTS})
                        cells.setdefault((name, n), []).append(res["tok_s"])
                        report(f"  repeat {rep + 1}/{repeats} streams={n} {name:<17} {res['tok_s']:7.2f} tok/s"
                               f"  (tokens per stream {res['min_tokens']}..{res['max_tokens']})")
            stage_ms = ring.ask({"cmd": "stats"})
            stage_ms_one = one.ask({"cmd": "stats"})
        finally:
            for c in reversed(children):
                c.close()
        load["after"] = os.getloadavg()

        table = {name: {str(n): round(statistics.median(cells[(name, n)]), 3) for n in streams}
                 for name, _child in cases}
        pinning = pinning_record(pin, allowed, bench_cores, cores[:2], ring.setup, one.setup,
                                 [mono.setup, mono_b.setup])
        out: dict[str, Any] = {
            "model": model, "ranges": [list(r) for r in ranges], "cores": cores[:2],
            "threads_per_process": args.threads, "tokens_per_stream": tokens,
            "prompt_tokens": [len(p) for p in prompts], "repeats": repeats,
            "aggregate_tok_s": table,
            "aggregate_tok_s_per_repeat": {f"{name}/{n}": [round(x, 3) for x in cells[(name, n)]]
                                           for name, n in cells},
            "stage_compute_ms_mean": stage_ms.get("stage_ms_mean"),
            "monolithic_engine_compute_ms_mean": (stage_ms_one.get("stage_ms_mean") or [None])[0],
            "loadavg": {k: [round(x, 2) for x in v] for k, v in load.items()},
            "goals": {"speedup_2streams": 1.85},
            "pinning": pinning, "pinning_note": pin["note"],
        }
        out.update(ratios(table, cells, streams))  # speedup_*, interleaving gain, pipeline_over_data_parallel
        # CURVE on the data plane: the same 2-stage ring with and without it (engine/bench/_curve.py);
        # its coordinators run in this (pinned) process.
        from engine.bench._curve import measure_curve_overhead

        out.update(measure_curve_overhead(path, recipe.demo_id, [infos[r].path for r in ranges], ranges, cores[:2],
                                          threads=args.threads, streams=tuple(n for n in streams if n <= 2) or (1,),
                                          tokens=tokens, repeats=repeats, blobs=blobs, hidden=args.hidden,
                                          log_dir=logs / "curve", report=report))
        if profiles:
            out["network"] = {p: _run_profile(p, common, ring_spec, ranges, cores, streams,
                                              args.net_tokens or (8 if PROFILES[p][0] >= 50 else tokens),
                                              max(1, repeats // 2) if PROFILES[p][0] >= 50 else repeats, report)
                              for p in profiles}
            pinning["network"] = {p: out["network"][p].pop("pinning") for p in profiles}
    return out


def _run_profile(profile: str, common: dict, ring_spec: dict, ranges, cores, streams, tokens: int, repeats: int,
                 report: Callable[[str], None]) -> dict[str, Any]:
    delay, rate = PROFILES[profile]
    nodes = ["c", "s0", "s1"]
    # SIGTERM would end us without running `finally`/`with` exits: turn it into an
    # exception while namespaces exist, so they are always deleted.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _profile_in_lab(profile, delay, rate, nodes, common, ring_spec, streams, tokens, repeats, report)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _profile_in_lab(profile: str, delay: float, rate: float | None, nodes: list[str], common: dict,
                    ring_spec: dict, streams, tokens: int, repeats: int,
                    report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench._netns import NetLab

    report(f"network profile {profile}: {delay} ms per hop" + (f", {rate:g} Mbit/s" if rate else ""))
    with NetLab(nodes, delay_ms=0.0, rate_mbit=rate) as lab:
        spec = dict(ring_spec)
        spec.update({
            "stage_prefix": [lab.exec_prefix("s0"), lab.exec_prefix("s1")],
            "host": None, "stage_hosts": [lab.address("s0"), lab.address("s1")],
            "coord_host": lab.address("c"),
            "relays": {"delay_ms": delay, "prefix": {n: lab.exec_prefix(n) for n in nodes}},
        })
        # The coordinator keeps its share (taskset inside its namespace); its relays inherit it.
        ring = Child([*lab.exec_prefix("c"), *taskset_prefix(spec["coord_cores"])], spec,
                     Path(common["log_dir"]) / f"ring-{profile}.log")
        cells: dict[int, list[float]] = {}
        try:
            ring.ask({"cmd": "run", "streams": 1, "tokens": 2, "prompts": PROMPTS})
            for rep in range(repeats):
                for n in streams:
                    res = ring.ask({"cmd": "run", "streams": n, "tokens": tokens, "prompts": PROMPTS})
                    cells.setdefault(n, []).append(res["tok_s"])
                    report(f"  {profile} repeat {rep + 1}/{repeats} streams={n} {res['tok_s']:7.2f} tok/s")
        finally:
            ring.close()
    tok_s = {str(n): round(statistics.median(v), 3) for n, v in cells.items()}
    return {"one_way_delay_ms_per_hop": delay, "rate_mbit": rate, "tokens_per_stream": tokens, "repeats": repeats,
            "delay_by": "user-space relay per node (no sch_netem in this kernel)",
            "rate_by": "tbf on every node's eth0" if rate else None, "aggregate_tok_s": tok_s,
            "interleaving_gain": {n: round(v / tok_s["1"], 3) for n, v in tok_s.items()} if "1" in tok_s else {},
            "pinning": {"coordinator": ring.setup["affinity"], "relays": ring.setup["affinity"],
                        "stages": ring.setup["stage_affinity"]}}

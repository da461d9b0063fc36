"""Core pinning and the data-parallel baseline of `flotilla bench pipeline`.

Pinning (what is fair). The pipeline's coordinator (engine.pipeline.coordinator:
sampling, detokenizing, messaging; no model compute) used to run unpinned, so it
took cycles from both stage cores, or, on a bigger machine, ran on cores no
baseline had. Now every process of the benchmark has an explicit share:

  stage i, monolithic, data-parallel replica i   one core each (taskset)
  coordinator  "own":    a core of its own that no stage and no baseline uses
                         (the default when there is a spare one: stage compute is
                         undisturbed, as on a fleet whose coordinator is the user's
                         PC; the pipeline then has 3 cores against 2);
               "shared": the cores of the stages it drives (both stage cores for the
                         2-stage ring, the one core of the 1-stage ring; the default
                         with 2 cores): the pipeline pays for its coordination out of
                         the same 2-core budget the data-parallel baseline gets, whose
                         replicas drive their model inline, on their own core.
The bench process itself (it hosts the in-process coordinators of the CURVE rings,
engine/bench/_curve.py) is pinned like a coordinator with os.sched_setaffinity,
every thread of it, and restored afterwards. The JSON records the cores each
process reported for itself.

Data-parallel baseline: two replicas of the WHOLE model, each in a monolithic child
process (the `monolithic` case's child and one more like it), one per stage core,
the same threads per process; n streams are split ceil(n/2) / floor(n/2) and both
replicas run at once. Aggregate tok/s = all generated tokens / (last replica's end
- first replica's start), CLOCK_MONOTONIC being one clock for all processes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

MODES = ("auto", "own", "shared")


def plan_pinning(stage_cores: list[int], allowed: set[int], mode: str = "auto") -> dict[str, Any]:
    """Cores of the coordinators: {"mode", "coordinator" (2-stage ring), "coordinator_1stage", "note"}."""
    if mode not in MODES:
        raise SystemExit(f"--coordinator must be one of {', '.join(MODES)}")
    spare = sorted(set(allowed) - set(stage_cores))
    if mode == "own" and not spare:
        raise SystemExit(f"--coordinator own needs a core besides the stage cores {stage_cores} "
                         f"(allowed: {sorted(allowed)})")
    if mode == "own" or (mode == "auto" and spare):
        c = [spare[0]]
        note = (f"coordinators (and the bench process) on core {c[0]}, which no stage or baseline uses: stage "
                f"compute is undisturbed, but the pipeline uses 3 cores (2 compute + 1 coordination) against 2 for "
                f"data_parallel and 1 for monolithic; pipeline_over_data_parallel favours the pipeline by the "
                f"coordinator's core (run with --coordinator shared for the equal-budget figure)")
        return {"mode": "own_core", "coordinator": c, "coordinator_1stage": c, "note": note}
    both = sorted(set(stage_cores))
    note = (f"no spare core: each coordinator is pinned to the cores of the stages it drives ({both} for the "
            f"2-stage ring, [{stage_cores[0]}] for the 1-stage ring), as is the bench process (the CURVE rings' "
            f"coordinators); the pipeline pays for its coordination out of the same 2 cores the data_parallel "
            f"replicas get (they drive their model inline, no coordinator), so pipeline_over_data_parallel "
            f"compares equal CPU budgets; speedup_vs_monolithic compares 2 cores with 1")
    return {"mode": "shared_with_stages", "coordinator": both, "coordinator_1stage": [stage_cores[0]], "note": note}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


@contextmanager
def pinned_process(cores: list[int]) -> Iterator[list[int]]:
    """Pin every thread of this process to `cores`; afterwards each thread gets its old mask back
    (threads started meanwhile get the calling thread's). sched_setaffinity acts on ONE thread, so
    the threads that already exist (OpenVINO's, BLAS's) are pinned one by one; new ones inherit."""
    mine = os.sched_getaffinity(0)
    before: dict[int, set[int]] = {}
    for tid in _threads():
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread has gone
            pass
    try:
        yield sorted(os.sched_getaffinity(0))
    finally:
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, before.get(tid, mine))
            except OSError:
                pass
        os.sched_setaffinity(0, mine)


def split_streams(n: int, k: int) -> list[int]:
    """n streams over k replicas: ceil first (1 stream leaves the second replica idle)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


class Replicas:
    """k monolithic children (engine.bench._pipeline_child.Child, `setup_mono`) answering `run` together,
    with the same interface as one child."""

    def __init__(self, children: list) -> None:
        self.children = children

    def ask(self, cmd: dict) -> dict:
        assert cmd["cmd"] == "run"
        prompts = cmd["prompts"]
        split = split_streams(int(cmd["streams"]), len(self.children))
        busy, first = [], 0
        for child, m in zip(self.children, split):
            if m:  # stream j of the whole gets the prompt the monolithic case gives stream j
                rot = first % len(prompts)
                child.send({**cmd, "streams": m, "prompts": prompts[rot:] + prompts[:rot]})
                busy.append(child)
            first += m
        answers, error = [], None
        for child in busy:  # collect every answer, so no child is left out of step
            try:
                answers.append(child.recv())
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
        if error is not None:
            raise error
        tokens = sum(a["tokens"] for a in answers)
        wall = max(a["t1"] for a in answers) - min(a["t0"] for a in answers)
        return {"tok_s": tokens / wall, "wall_s": wall, "split": split,
                "min_tokens": min(a["min_tokens"] for a in answers),
                "max_tokens": max(a["max_tokens"] for a in answers)}


def taskset_prefix(cores: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores))]


def pinning_record(pin: dict, allowed: set[int], bench: list[int], stage_cores: list[int], ring: dict, one: dict,
                   replicas: list[dict]) -> dict[str, Any]:
    """The `pinning` field: the cores each process reported for itself (setup answers of the children)."""
    return {
        "allowed": sorted(allowed), "coordinator_mode": pin["mode"], "bench_process": bench,
        "pipeline_2stages": {"coordinator": ring["affinity"], "stages": ring["stage_affinity"]},
        "monolithic_engine": {"coordinator": one["affinity"], "stages": one["stage_affinity"]},
        "monolithic": replicas[0]["affinity"],
        "data_parallel": [r["affinity"] for r in replicas],
        "curve_rings": {"coordinator": bench, "stages": [[c] for c in stage_cores]},  # taskset, as above
    }


def ratios(table: dict, cells: dict, streams: list[int]) -> dict[str, Any]:
    """The ratio fields, from the medians in `table` (and per repeat from `cells`)."""
    pipe, mono, dp = table["pipeline_2stages"], table["monolithic"], table["data_parallel"]
    out: dict[str, Any] = {}
    if 1 in streams:
        out["speedup_by_streams"] = {str(n): round(pipe[str(n)] / mono["1"], 3) for n in streams}
        if 2 in streams:  # speedup_vs_monolithic: the same figure under a clearer name
            out["speedup_2streams"] = out["speedup_vs_monolithic"] = out["speedup_by_streams"]["2"]
            out["speedup_2streams_per_repeat"] = [round(p / m, 3) for p, m in
                                                  zip(cells[("pipeline_2stages", 2)], cells[("monolithic", 1)])]
        one1 = table["monolithic_engine"]["1"]
        out["speedup_vs_monolithic_engine_by_streams"] = {str(n): round(pipe[str(n)] / one1, 3) for n in streams}
        out["interleaving_gain_loopback"] = {str(n): round(pipe[str(n)] / pipe["1"], 3) for n in streams}
    out["pipeline_over_data_parallel_by_streams"] = {str(n): round(pipe[str(n)] / dp[str(n)], 3) for n in streams}
    out["data_parallel_streams_split"] = {str(n): split_streams(n, 2) for n in streams}
    if 2 in streams:
        out["pipeline_over_data_parallel"] = out["pipeline_over_data_parallel_by_streams"]["2"]
        out["pipeline_over_data_parallel_per_repeat"] = [
            round(p / d, 3) for p, d in zip(cells[("pipeline_2stages", 2)], cells[("data_parallel", 2)])]
    return out

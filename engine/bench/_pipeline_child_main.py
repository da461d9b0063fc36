"""The child side of `flotilla bench pipeline`: a helper process serving JSON commands on
stdin (set up the monolithic model or the stage ring with its relays, run N streams,
report stage times, quit), started by engine.bench._pipeline_child.Child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine.bench._pipeline_child import REPO_ROOT, answer_commands, stop_group
from engine.shards.worker_process import WORKER_MODULE, read_bound, worker_env


def main() -> None:
    """Serve JSON commands on stdin (answer_commands) until quit, then stop what was started."""
    state: dict[str, Any] = {}
    answer_commands(lambda cmd: _handle(state, cmd))
    _teardown(state)


def _handle(state: dict, cmd: dict) -> dict:
    kind = cmd["cmd"]
    if kind == "setup_mono":
        from engine.shards.runtime import ShardRunner

        state["mono"] = ShardRunner(Path(cmd["shard"]), cache_dir=Path(cmd["blobs"]),
                                    config={"INFERENCE_NUM_THREADS": int(cmd["threads"])})
        return {"ok": True, "affinity": sorted(os.sched_getaffinity(0))}
    if kind == "setup_ring":
        _setup_ring(state, cmd)
        return {"ok": True, "affinity": sorted(os.sched_getaffinity(0)),
                "stage_affinity": [sorted(os.sched_getaffinity(p.pid)) for p in state["stages"]]}
    if kind == "run":
        if "mono" in state:
            return _run_mono(state["mono"], cmd["streams"], cmd["tokens"], cmd["prompts"])
        return _run_ring(state["engine"], cmd["streams"], cmd["tokens"], cmd["prompts"])
    if kind == "stats":
        eng = state.get("engine")
        if eng is None:
            return {}
        st = eng.stats
        return {"stage_ms_mean": [round(ms / max(1, st.steps), 3) for ms in st.stage_ms], "steps": st.steps}
    if kind == "quit":
        _teardown(state)
        return {"ok": True}
    raise ValueError(f"unknown command {kind!r}")


def _run_mono(runner, n: int, tokens: int, prompts: list[list[int]]) -> dict:
    """N greedy streams round-robin on one compiled whole model (prefill + decode timed)."""
    import numpy as np

    streams = [runner.new_stream() for _ in range(n)]
    ids = [list(prompts[i % len(prompts)]) for i in range(n)]
    past = [0] * n
    counts = [0] * n
    t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable across the data-parallel replicas
    feed_ids = ids
    for _ in range(tokens):
        nxt = []
        for i, s in enumerate(streams):
            x = np.array([feed_ids[i]], np.int64)
            k = x.shape[1]
            out = s.run({"input_ids": x, "attention_mask": np.ones((1, past[i] + k), np.int64),
                         "position_ids": np.arange(past[i], past[i] + k, dtype=np.int64)[None]})
            past[i] += k
            counts[i] += 1
            nxt.append([int(out["next_token"][0, -1])])
        feed_ids = nxt
    t1 = time.monotonic()
    wall = t1 - t0
    return {"tok_s": sum(counts) / wall, "wall_s": wall, "min_tokens": min(counts), "max_tokens": max(counts),
            "tokens": sum(counts), "t0": t0, "t1": t1}


def _run_ring(engine, n: int, tokens: int, prompts: list[str]) -> dict:
    from engine.protocol.messages import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(f"b{time.monotonic_ns()}-{i}", prompt=prompts[i % len(prompts)],
                            sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)) for i in range(n)]
    finals: list[Any] = [None] * n

    def drain(i: int, rid: str) -> None:
        last = None
        for ev in engine.stream(rid):
            last = ev
        finals[i] = last

    t0 = time.perf_counter()
    ids = [engine.submit(r) for r in reqs]
    threads = [threading.Thread(target=drain, args=(i, rid)) for i, rid in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for f in finals:
        if f is None or f.error:
            raise RuntimeError(f"a pipeline request failed: {getattr(f, 'error', 'no answer')}")
    counts = [f.usage.completion_tokens for f in finals]
    return {"tok_s": sum(counts) / wall, "wall_s": wall, "min_tokens": min(counts), "max_tokens": max(counts)}


def _setup_ring(state: dict, cmd: dict) -> None:
    """Start the relays (network profiles), the 2 pinned stage workers and the coordinator."""
    from engine.pipeline.coordinator import PipelineConfig, PipelineEngine, StageLink

    env = worker_env()
    log_dir = Path(cmd["log_dir"])
    procs: list[subprocess.Popen] = state.setdefault("procs", [])
    hosts = cmd.get("stage_hosts") or [cmd["host"]] * len(cmd["shards"])
    links = []
    for i, (shard, (start, end), core) in enumerate(zip(cmd["shards"], cmd["ranges"], cmd["cores"])):
        argv = [*cmd["stage_prefix"][i], "taskset", "-c", str(core), sys.executable, "-m", WORKER_MODULE,
                "--shard", shard, "--bind", f"tcp://{hosts[i]}:*", "--name", f"stage {i}",
                "--threads", str(cmd["threads"]), "--cache-dir", cmd["blobs"], "--parent-pid", str(os.getpid())]
        log_path = log_dir / f"stage-{i}-{os.getpid()}.log"
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf, env=env,
                                    cwd=str(REPO_ROOT), start_new_session=True)
        procs.append(proc)
        state.setdefault("stages", []).append(proc)
        endpoint = _read_endpoint(proc, log_path)
        links.append(StageLink(i, start, end, endpoint, proc=proc, log_path=log_path))
    pcfg = dict(max_concurrent=int(cmd["max_concurrent"]), return_bind=f"tcp://{cmd['coord_host']}:*",
                ready_timeout_s=300.0, ping_timeout_s=120.0)
    relays = cmd.get("relays")
    if relays:
        # Each node's inbound sockets sit behind a delaying relay in its own namespace:
        # the coordinator and the previous stage dial the relay, never the worker itself.
        for i, link in enumerate(links):
            link.endpoint = _start_relay(state, relays["prefix"][f"s{i}"], link.endpoint, relays["delay_ms"],
                                         log_dir, env)
        import zmq

        probe = zmq.Context.instance().socket(zmq.ROUTER)  # reserve the return port, then hand it over
        port = probe.bind_to_random_port(f"tcp://{cmd['coord_host']}")
        probe.close(0)
        real = f"tcp://{cmd['coord_host']}:{port}"
        pcfg["return_bind"] = real
        pcfg["return_endpoint"] = _start_relay(state, relays["prefix"]["c"], real, relays["delay_ms"], log_dir, env)
    engine = PipelineEngine(links, Path(cmd["model_path"]), cmd["model_id"], PipelineConfig(**pcfg))
    state["engine"] = engine


def _start_relay(state: dict, prefix: list[str], target: str, delay_ms: float, log_dir: Path, env: dict) -> str:
    """A delaying TCP relay next to `target` (same host, another port); returns its endpoint."""
    host, port = target.removeprefix("tcp://").rsplit(":", 1)
    argv = [*prefix, sys.executable, "-m", "engine.bench._netns", "relay", "--listen", f"{host}:0",
            "--to", f"{host}:{port}", "--delay-ms", str(delay_ms)]
    log_path = log_dir / f"relay-{host}-{port}.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf, env=env,
                                cwd=str(REPO_ROOT), start_new_session=True)
    state.setdefault("procs", []).append(proc)
    return _read_endpoint(proc, log_path)


def _read_endpoint(proc: subprocess.Popen, log_path: Path, timeout: float = 120.0) -> str:
    """The endpoint in the first stdout line of a worker or relay ({"endpoint": ...})."""
    return read_bound(proc, f"process {proc.pid}", log_path, timeout)


def _teardown(state: dict) -> None:
    engine = state.pop("engine", None)
    if engine is not None:
        try:
            engine.close()
        except Exception:
            pass
    for proc in reversed(state.pop("procs", [])):
        stop_group(proc)

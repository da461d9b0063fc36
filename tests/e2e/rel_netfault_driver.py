"""Child of test_rel_netfaults.py, run inside the lab's coordinator namespace.

    ip netns exec LAB-c python rel_netfault_driver.py SPEC_JSON

Starts one shard worker per stage namespace (`ip netns exec LAB-sI python -m
engine.shards.worker --bind tcp://ADDR:*`), wires a PipelineEngine to them
with a re-plan provider that restarts a lost stage in the spare namespaces
(one use each), computes reference answers, then obeys stdin lines:

    {"cmd": "round", "streams": N}  -> starts N streams; prints {"event": "streaming"}
                                       once each has 10 tokens, then
                                       {"event": "result", ...} when all ended
    {"cmd": "quit"}

The parent applies network faults between "streaming" and "result".
"""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from engine.pipeline.coordinator import PipelineConfig, PipelineEngine, StageLink
from engine.pipeline.recovery_provider import RecoveryImpossible
from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

spec = json.loads(sys.argv[1])
log_dir = Path(spec["log_dir"])
procs: list[subprocess.Popen] = []


def start_worker(prefix: list[str], addr: str, shard: str, name: str) -> StageLink:
    log = open(log_dir / f"{name.replace(' ', '-')}-{len(procs)}.log", "ab")
    cmd = [*prefix, sys.executable, "-m", "engine.shards.worker", "--shard", shard, "--bind", f"tcp://{addr}:*",
           "--name", name, "--exact", "--parent-pid", str(os.getpid())]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
    procs.append(p)
    line = p.stdout.readline()
    if not line:
        raise RecoveryImpossible(f"{name} did not start")
    return StageLink(0, 0, 1, json.loads(line)["endpoint"], proc=p)


spares = list(spec["spares"])  # [[prefix, addr], ...]: each hosts one replacement


class Provider:
    def replan(self, loss):
        links = list(loss.stages)
        for i in loss.lost:
            if not spares:
                raise RecoveryImpossible(f"no peer is left to host layers {links[i].start}–{links[i].end}")
            prefix, addr = spares.pop(0)
            new = start_worker(prefix, addr, spec["shards"][i], f"stage {i}")
            links[i] = replace(links[i], endpoint=new.endpoint, proc=new.proc, pid=None)
        return links

    def retire(self, links, reason):
        for link in links:
            if link.proc is not None and link.proc.poll() is None:
                link.proc.kill()


links = []
for i, (prefix, addr) in enumerate(spec["stages"]):
    link = start_worker(prefix, addr, spec["shards"][i], f"stage {i}")
    links.append(replace(link, index=i, start=spec["ranges"][i][0], end=spec["ranges"][i][1]))
engine = PipelineEngine(links, Path(spec["model_dir"]), "demo",
                        PipelineConfig(return_bind=f"tcp://{spec['coord_addr']}:*", ready_timeout_s=120))
engine.enable_recovery(Provider())
sampling = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)  # faults must land mid-answer


def req(rid, i):
    return GenerateRequest(rid, messages=(ChatMessage("user", f"Tell me a story about robot number {i}."),),
                           sampling=sampling)


refs = {}
for i in range(spec["max_streams"]):
    refs[i] = [t for ev in engine.stream(engine.submit(req(f"ref{i}", i)), timeout=60) for t in ev.token_ids]


def emit(obj):
    print(json.dumps(obj), flush=True)


emit({"event": "ready"})
rounds = 0
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "quit":
        break
    rounds += 1
    n = cmd["streams"]
    got = {i: [] for i in range(n)}
    finals = {}
    before = len(engine.recovery.records)

    def read(i, rid):
        try:
            for ev in engine.stream(rid, timeout=spec["stream_timeout_s"]):
                got[i] += ev.token_ids
                if ev.final:
                    finals[i] = (ev.finish_reason, ev.error)
        except Exception as e:  # a timeout here = a hang: reported as such
            finals[i] = ("hang", f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    try:
        rids = [engine.submit(req(f"r{rounds}-{i}", i)) for i in range(n)]
    except Exception as e:
        emit({"event": "streaming"})
        emit({"event": "result", "refused": str(e), "finals": {}, "identical": [], "records": [], "elapsed_s": 0})
        continue
    readers = [threading.Thread(target=read, args=(i, r), daemon=True) for i, r in enumerate(rids)]
    for t in readers:
        t.start()
    while min(len(v) for v in got.values()) < 10 and len(finals) < n:
        time.sleep(0.005)
    emit({"event": "streaming", "t": time.monotonic()})
    for t in readers:
        t.join(spec["stream_timeout_s"] + 5)
    recs = [r.to_dict() | {"detected": r.detected} for r in engine.recovery.records[before:]]
    emit({"event": "result", "finals": finals, "identical": [got[i] == refs[i] for i in range(n)],
          "tokens": [len(got[i]) for i in range(n)], "records": recs, "elapsed_s": time.monotonic() - t0,
          "state": engine.load().state})
engine.close()
for p in procs:
    if p.poll() is None:
        p.kill()
    p.wait()

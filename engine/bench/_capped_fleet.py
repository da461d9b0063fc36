"""A 2-agent fleet on this PC where every agent (and the shard worker it starts) lives in its
own capped cgroup-v1 memory group, launched the way a user launches it (engine/fleet/launch.py).

    run = run_capped_fleet(model_path, "int4", caps=CapRule(fraction=0.75, whole_model_bytes=...),
                           context_length=1024, streams=(1, 2), tokens=64, report=print)

1. Two `flotilla agent --headless` processes start inside their memory groups from birth
   (loopback only, demo-mode pairing, their own config and data under a fresh temp folder).
2. They are found over mDNS on 127.0.0.1 and paired; FleetSession.launch plans an even
   2-stage split at the given weights, packs the shards that the capped exporter already put
   in the shard cache (it must not export: a progress line "exporting" aborts the run, as the
   controller would then load the checkpoint itself), sends them and starts the workers.
3. Caps: as soon as the plan exists (before any shard is sent), each agent's group gets
   max(fraction x whole model at that precision, the plan's memory for its stage's process)
   (CapRule); the run says whether that is still below the whole model (`cap_below_model`).
4. A warm-up request (its first token includes compiling the shards), then N = 1, 2 streams
   generating `tokens` tokens each (ignore_eos): aggregate tok/s, time to first token,
   decode tok/s; the token ids of the first stream are kept (tests compare them).
   Then the fill run (fill=True): max(streams) streams whose prompts take the plan's whole
   context (less FILL_TOKENS generated), so every worker reaches the KV and the prefill
   chunks the plan reserved memory for: the measured peak is the one the plan predicts.
5. Every group is sampled all along: per process VmHWM and RssAnon peaks (agent and worker
   apart), the group's max_usage, failcnt, OOM kills.
Disk: the controller sends each bundle straight from its shard folder (no archive written), and
with free_disk_as_sent the shard folders go once every agent has its shard: at worst the disk
holds the model twice (the controller's shards + the agents' copies), not 3-5 times.
Everything started is stopped and every file written (bundles, agents' shards) removed.
"""

from __future__ import annotations

from engine import aio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from engine.bench._cgroup import MemoryGroup, PeakSampler, read_status

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time, in a small town by the sea, there lived"
FILL_TOKENS = 8  # generated per stream by the fill run, after a prompt filling the context
FILL_MARGIN = 16  # tokens left free of the context (a tokenizer's BOS, rounding)


@dataclass(frozen=True)
class CapRule:
    """How each agent's memory group is capped: base + fraction x the whole model, and never below
    what the plan says the stage's process needs (weights + KV + runtime reserve; the plan's OS
    reserve is RAM left to the peer's OS, not to the worker) plus what the agent, which shares the
    group, holds itself when the cap is set (~90 MB RSS; without it an int4 stage whose cap was its
    plan exactly was OOM-killed on a bf16 CPU, its worker's own peak 6 % under the plan)."""

    fraction: float  # of the whole model at the run's precision (e.g. 0.75)
    whole_model_bytes: int  # the sum of the stages' shard files
    at_least_plan: bool = True  # never below the plan's process memory for the stage
    base_bytes: int = 0  # what the processes hold with no model (small models in tests); 0 = none

    def cap(self, planned_process_bytes: int | None) -> int:
        c = self.base_bytes + int(self.fraction * self.whole_model_bytes)
        if self.at_least_plan and planned_process_bytes:
            c = max(c, int(planned_process_bytes))
        return c

    def below_model(self, cap: int) -> bool:
        """The part of the cap left for the model is smaller than the whole model."""
        return cap - self.base_bytes < self.whole_model_bytes


def _resident_bytes(group: MemoryGroup) -> int:
    """VmRSS of the processes in a group now (an agent before its worker starts)."""
    total = 0
    for pid in group.pids():
        st = read_status(pid)
        total += st.get("VmRSS", 0) if st else 0
    return total


def planned_process_bytes(stage: Any) -> int:
    """A plan stage's memory for its process: total minus the OS reserve (when the planner has one)."""
    return int(stage.total_bytes) - int(getattr(stage, "os_reserve_bytes", 0) or 0)


class LauncherWouldExport(RuntimeError):
    """The launcher found no cached shard and would export in the controller (uncapped)."""


class _Agents:
    """N agent processes, each in its own memory group from birth."""

    def __init__(self, root: Path, controller_key: str, groups: Sequence[MemoryGroup]) -> None:
        from engine.fleet.demo_mode import make_agent_dir
        from engine.fleet.policy import SharingPolicy

        self.root, self.groups = root, list(groups)
        self.procs: list[subprocess.Popen] = []
        self.configs: list[Path] = []
        ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        for i in range(len(self.groups)):
            config = make_agent_dir(root, f"agent-{i}", controller_key)
            # Idle by construction; the cgroup, not the policy, is the memory cap measured here.
            SharingPolicy(idle_minutes=0.0, require_ac=False, max_cpu_percent_to_start=100.0,
                          max_ram_gb=round(ram_gb, 1)).save(config)
            self.configs.append(config)

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.pop("FLOTILLA_DATA", None)
        for i, (config, group) in enumerate(zip(self.configs, self.groups)):
            argv = [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "--bind", "127.0.0.1",
                    "--port", "0", "--interface", "127.0.0.1", "--idle-source", "none", "--mdns-ttl", "10",
                    "--demo-auto-pair"]
            with open(self.root / f"agent-{i}.out", "ab") as out:
                self.procs.append(group.popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                              env={**env, "FLOTILLA_CONFIG": str(config)}, cwd=str(REPO_ROOT),
                                              start_new_session=True))

    def public_keys(self, timeout: float = 60.0) -> list[str]:
        end = time.monotonic() + timeout
        keys = []
        for i, config in enumerate(self.configs):
            path = config / "node_key.public"
            while not path.exists():
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"agent {i} exited at once (code {self.procs[i].returncode}): "
                                       f"{_tail(self.root / f'agent-{i}.out')}")
                if time.monotonic() > end:
                    raise RuntimeError(f"agent {i} made no identity within {timeout:.0f} s")
                time.sleep(0.05)
            keys.append(path.read_text().strip())
        return keys

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                _killpg(p.pid, signal.SIGTERM)  # the agent stops its workers, then exits
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _killpg(p.pid, signal.SIGKILL)
                p.wait()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def _generate(engine: Any, n: int, tokens: int, prompt: str, timeout: float) -> dict[str, Any]:
    """n requests at once; aggregate tok/s over the wall time from submit to the last token."""
    from engine.protocol.messages import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(f"scale-{time.monotonic_ns()}-{i}", prompt=prompt,
                            sampling=SamplingParams(max_tokens=tokens, ignore_eos=True)) for i in range(n)]
    finals: list[Any] = [None] * n
    ids: list[list[int]] = [[] for _ in range(n)]

    def drain(i: int, rid: str) -> None:
        for ev in engine.stream(rid, timeout=timeout):
            ids[i].extend(ev.token_ids)
            finals[i] = ev

    t0 = time.perf_counter()
    rids = [engine.submit(r) for r in reqs]
    threads = [threading.Thread(target=drain, args=(i, rid), daemon=True) for i, rid in enumerate(rids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    wall = time.perf_counter() - t0
    errors = [getattr(f, "error", None) or ("no final event" if f is None else None) for f in finals]
    errors = [e for e in errors if e]
    counts = [f.usage.completion_tokens if f is not None and f.usage else len(x) for f, x in zip(finals, ids)]
    prompts = [f.usage.prompt_tokens for f in finals if f is not None and f.usage]
    timings = [f.timings for f in finals if f is not None and f.timings is not None]
    return {
        "streams": n, "tokens": counts, "wall_s": round(wall, 3),
        "tok_s": round(sum(counts) / wall, 3) if wall > 0 else None,
        "ttft_s": round(sum(t.ttft_s for t in timings) / len(timings), 3) if timings else None,
        "decode_tok_s": round(sum(t.decode_tok_s for t in timings) / len(timings), 3) if timings else None,
        "token_ids": ids[0], "errors": errors, "prompt_tokens": min(prompts) if prompts else None,
    }


def fill_prompt(model_path: Path, n_tokens: int) -> str:
    """Text of about n_tokens tokens for this model's tokenizer (PROMPT repeated, cut at a token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    one = tok.encode(" " + PROMPT, add_special_tokens=False)
    ids = (one * (n_tokens // max(1, len(one)) + 1))[:n_tokens]
    return tok.decode(ids)


def run_capped_fleet(model_path: Path, precision: str, caps: CapRule, *, context_length: int,
                     streams: Sequence[int] = (1, 2), tokens: int = 64, exact: bool = False, fill: bool = True,
                     prompt: str = PROMPT, report: Callable[[str], None] | None = None,
                     request_timeout_s: float = 600.0, free_disk_as_sent: bool = True,
                     log_dir: Path | None = None) -> dict[str, Any]:
    """Launch, generate, measure, tear down. Never raises for what it measures: errors are in
    the result ("error", per-stream "errors"), with whatever the groups recorded."""
    from engine.fleet.demo_mode import make_demo_root
    from engine.fleet.controller_setup import async_discover, async_pair_all, controller_keys
    from engine.fleet.launch_config import LaunchConfig
    from engine.fleet.session import FleetSession

    say = report or (lambda _line: None)
    root = make_demo_root()
    groups: list[MemoryGroup] = []
    samplers: list[PeakSampler] = []
    agents: _Agents | None = None
    engine = None
    session = None
    caps_set: dict[str, Any] = {}  # node_id -> the cap its group got from the plan
    agent_at_cap: dict[str, int] = {}  # node_id -> its agent's resident bytes when the cap was set
    group_of: dict[str, MemoryGroup] = {}  # node_id -> its agent's group
    out: dict[str, Any] = {"precision": precision, "error": None}
    try:
        keys = controller_keys(root / "controller")
        provisional = caps.cap(None)
        groups = [MemoryGroup(f"agent{i}", provisional) for i in range(2)]
        agents = _Agents(root, keys.public, groups)
        agents.start()
        samplers = [PeakSampler(g, interval=0.1).start() for g in groups]
        agent_keys = agents.public_keys()
        peers = aio.run(async_discover(["127.0.0.1"], keys=set(agent_keys), timeout=30.0))
        if len(peers) < 2:
            raise RuntimeError(f"found {len(peers)} of 2 agents over mDNS on 127.0.0.1 (logs in {root})")
        states = aio.run(async_pair_all(keys, peers, "flotilla-bench-scale", wait=10.0))
        if any(s != "accepted" for s in states.values()):
            raise RuntimeError(f"pairing did not complete: {states}")
        group_of.update({p.node_id: groups[agent_keys.index(p.info.public_key)] for p in peers})

        def progress(_message: str, _fraction: float) -> None:
            if session is not None and session.plan is not None and not caps_set:
                for st, planned in zip(session.stages, session.plan.stages):
                    # The agent shares its worker's group: the floor is the worker's planned memory
                    # plus what the agent itself holds now (no worker yet), not the plan alone.
                    agent_bytes = _resident_bytes(group_of[st.peer.node_id])
                    cap = caps.cap(planned_process_bytes(planned) + agent_bytes)
                    group_of[st.peer.node_id].set_limit(cap)
                    caps_set[st.peer.node_id] = cap
                    agent_at_cap[st.peer.node_id] = agent_bytes
                say("  caps set from the plan: " + ", ".join(
                    f"stage {st.index} {caps_set[st.peer.node_id] / 1e9:.2f} GB" for st in session.stages))

        def on_stage(step: Any) -> None:  # engine.fleet.launch_reports.StageProgress: fields, not words
            if step.phase == "export":
                raise LauncherWouldExport(f"the launcher found no cached shard ({step.message}): it would "
                                          "export in the controller, outside any cap")
            if free_disk_as_sent and step.phase == "start":
                # Every agent has its shard: the controller's copies are not needed any more
                # (the bundles were read on the fly from these folders while they were sent).
                for st in session.stages:
                    if st.shard_path is not None and st.shard_path.exists():
                        shutil.rmtree(st.shard_path, ignore_errors=True)
                _drop_bundles(session.stages)

        cfg = LaunchConfig(model=str(model_path), stages=2, exact=exact, weights=precision,
                           context_length=context_length, max_concurrent=max(streams),
                           device_preference=("CPU",), controller_host="127.0.0.1", recover=False,
                           local_fallback=False, load_timeout_s=600.0, ready_timeout_s=900.0)
        session = FleetSession(keys, peers, cfg, progress, on_stage=on_stage)
        t0 = time.monotonic()
        say(f"  launching 2 stages at {precision} on 2 capped agents")
        engine = session.launch()
        out["launch_s"] = round(time.monotonic() - t0, 2)
        out["plan"] = session.plan.to_dict()
        warm = _generate(engine, 1, 4, prompt, request_timeout_s)
        out["cold_ttft_s"] = warm["ttft_s"]
        out["runs"] = {}
        for n in streams:
            res = _generate(engine, n, tokens, prompt, request_timeout_s)
            out["runs"][str(n)] = res
            say(f"  {precision}: {n} stream(s) {res['tok_s']} tok/s, first token {res['ttft_s']} s"
                + (f", errors {res['errors']}" if res["errors"] else ""))
        if fill:
            n = max(streams)
            text = fill_prompt(model_path, context_length - FILL_TOKENS - FILL_MARGIN)
            say(f"  {precision}: filling the {context_length}-token context with {n} stream(s)")
            res = _generate(engine, n, FILL_TOKENS, text, request_timeout_s)
            out["fill"] = res
            say(f"  {precision}: fill run {res['prompt_tokens']} prompt tokens per stream, first token "
                f"{res['ttft_s']} s" + (f", errors {res['errors']}" if res["errors"] else ""))
    except Exception as e:  # noqa: BLE001 - measured and reported, never a traceback for an OOM
        out["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        say(f"  {precision}: {out['error']}")
    finally:
        stages = list(session.stages) if session is not None else []
        plan = session.plan if session is not None else None
        workers = []
        for st in stages:
            g = group_of.get(st.peer.node_id)
            i = groups.index(g) if g is not None else None
            workers.append({"stage": st.index, "layers": [st.start, st.end], "node_id": st.peer.node_id,
                            "worker_pid": st.pid, "_group": i})
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001
                pass
        elif session is not None:
            session.stop()
        for s in samplers:
            s.stop()
        stats = [g.stats() for g in groups]
        if agents is not None:
            agents.stop()
        for g in groups:
            g.close()
        _drop_bundles(stages)  # the controller's packed bundles of this run
        if log_dir is not None:  # the agents' and workers' logs outlive the temp folder
            _keep_logs(root, Path(log_dir) / f"fleet-{precision}")
        shutil.rmtree(root, ignore_errors=True)
        out["workers"] = [{**_worker_record(w, plan, stats, samplers, agents, caps, caps_set),
                           "agent_bytes_at_cap": agent_at_cap.get(w["node_id"])} for w in workers]
        out["groups"] = [s.to_dict() for s in stats]
    return out


def _drop_bundles(stages: Sequence[Any]) -> None:
    for st in stages:
        if st.bundle is not None:  # cached_bundle keeps only the hash: <cache>/bundles/<shard key>.sha256
            from engine.fleet.bundle import BUNDLE_SUFFIX
            from engine.models.demo import cache_root

            for suffix in (".sha256", BUNDLE_SUFFIX):
                (cache_root() / "bundles" / f"{st.bundle.folder.name}{suffix}").unlink(missing_ok=True)


def _keep_logs(root: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for p in list(root.glob("agent-*.out")) + list(root.glob("agent-*/**/*.log")):
        try:
            shutil.copy(p, dest / f"{p.relative_to(root).parts[0]}-{p.name}")
        except OSError:
            pass


def _worker_record(w: dict, plan: Any, stats: list, samplers: list[PeakSampler], agents: _Agents | None,
                   caps: CapRule, caps_set: dict) -> dict[str, Any]:
    i = w.pop("_group")
    planned = plan.stages[w["stage"]] if plan is not None else None
    st = stats[i] if i is not None else None
    peak = samplers[i].peak(w["worker_pid"]) if i is not None and w["worker_pid"] else None
    agent_peak = samplers[i].peak(agents.procs[i].pid) if i is not None and agents is not None else None
    cap = caps_set.get(w["node_id"], st.limit_bytes if st else None)
    planned_process = planned_process_bytes(planned) if planned else None
    anon = peak.rss_anon_peak_bytes if peak else None
    return {
        **w,
        "cap_bytes": cap, "cap_base_bytes": caps.base_bytes,
        "cap_below_model": cap is not None and caps.below_model(cap),
        "planned_bytes": planned.total_bytes if planned else None,
        "planned_process_bytes": planned_process,
        # how far the plan's process memory is from the measured anonymous peak (+: plan higher)
        "plan_vs_anon": round(planned_process / anon - 1, 4) if planned_process and anon else None,
        # the planner's parts (weights, KV, reserves: whichever it has), bytes only
        "planned": ({k: v for k, v in planned.to_dict().items() if k.endswith("_bytes") and k != "ram_free_bytes"}
                    if planned else None),
        "peak_rss_bytes": peak.vm_hwm_bytes if peak else None,
        "rss_anon_peak_bytes": peak.rss_anon_peak_bytes if peak else None,
        "rss_file_at_anon_peak_bytes": peak.rss_file_at_anon_peak_bytes if peak else None,
        "agent_peak_rss_bytes": agent_peak.vm_hwm_bytes if agent_peak else None,
        "agent_rss_anon_peak_bytes": agent_peak.rss_anon_peak_bytes if agent_peak else None,
        "cgroup_max_usage_bytes": st.max_usage_bytes if st else None,
        "failcnt": st.failcnt if st else None, "oom_kills": st.oom_kills if st else None,
    }

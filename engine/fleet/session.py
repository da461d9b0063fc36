"""FleetSession: one pipeline's agents -- control clients, shards, workers and their
events -- launched step by step (engine/fleet/launch.py tells the whole story)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.aio import LoopThread
from engine.fleet.client import AgentClient, AgentRefused, FleetError, NotPaired
from engine.fleet.controller_setup import local_address_toward
from engine.fleet.discovery import Peer
from engine.fleet.launch_config import LaunchConfig
from engine.fleet.launch_errors import _raise_refusals, _refused
from engine.fleet.launch_plan import LaunchPlanning
from engine.fleet.launch_reports import FleetEvent, Progress, StageProgress
from engine.fleet.ring_provider import FleetRingProvider
from engine.fleet.ring_stage import RemoteWorker, _Stage, _stop_local
from engine.planner import weights as plan_weights
from engine.planner.plan import Plan, PlanModel
from engine.protocol.control import AgentEvent, StatusReply
from engine.transport.curve_data import CurveEnd
from engine.transport.security import KeyPair

log = logging.getLogger(__name__)


class FleetSession(LaunchPlanning):
    """One pipeline's agents: control clients, shards, workers and their events."""

    def __init__(self, keys: KeyPair, peers: Sequence[Peer], cfg: LaunchConfig = LaunchConfig(),
                 progress: Progress | None = None, plan: Plan | None = None,
                 on_stage: Callable[[StageProgress], None] | None = None) -> None:
        if not peers:
            raise FleetError("no agents to launch on: start `flotilla agent` on the PCs (and pair them)")
        self.keys, self.cfg = keys, cfg
        self.peers = {p.node_id: p for p in peers}
        self.progress = progress or (lambda _m, _f: None)
        self.on_stage = on_stage or (lambda _p: None)
        self.user_plan = plan  # the user's plan: launched as is (checked, never re-planned); None = we plan
        self.plan: Plan | None = None  # the plan being launched (the user's very object when given)
        self.plan_lines: list[str] = []  # the plan as reported before export (when the launcher planned)
        self.stages: list[_Stage] = []
        self.statuses: dict[str, StatusReply] = {}
        self.left_out: dict[str, str] = {}  # node_id -> why it was not used
        self.events: list[FleetEvent] = []  # every event about our stages, in order
        self.engine: Any = None
        self.break_on_event = not cfg.recover  # stop the engine when a stage's agent yields or its worker dies
        self.provider: FleetRingProvider | None = None  # recovery (cfg.recover)
        self._all: list[_Stage] = []  # every stage ever started (unloaded at stop)
        self._host = "127.0.0.1"  # the address stages dial back (and local workers bind)
        self._local_dir: Path | None = None  # this PC's key file for local workers
        self._listeners: list[Callable[[FleetEvent], None]] = []
        self._clients: dict[str, AgentClient] = {}
        self._loop = LoopThread("flotilla-fleet")
        self._watch: asyncio.Future | None = None
        self._stopped = False
        self.timings: dict[str, float] = {}

    def add_listener(self, listener: Callable[[FleetEvent], None]) -> None:
        """Called (on the session's thread) for every FleetEvent. With recovery
        on (cfg.recover) the session migrates / recovers the stage itself after
        the listeners ran; with it off the engine stops unless break_on_event
        is set False (then the listener handles the event)."""
        self._listeners.append(listener)

    # -- steps -------------------------------------------------------------------
    def launch(self) -> Any:
        """Plan, send, load and wire; returns the PipelineEngine (engine.fleet = self)."""
        from engine.models import profile_model, resolve_model
        from engine.models.profile import engine_context, trained_context

        t0 = time.monotonic()
        resolved = resolve_model(self.cfg.model, self.progress)
        model_path = Path(resolved.path)
        self.model_id = resolved.model_id
        plan_weights.refuse_unsupported(model_path)  # before any plan or export
        self._trained = trained_context(model_path)
        if self.user_plan is not None:  # the plan's context and streams, as the user saw them
            self.context_length, self.streams = self.user_plan.context_length, self.user_plan.streams
        else:  # None: what a chat user picks (DEFAULT_CONTEXT, at most the model's), not its maximum
            self.context_length = engine_context(model_path, self.cfg.context_length)
            self.streams = self.cfg.max_concurrent
        model = PlanModel.from_profile(profile_model(resolved))
        # The tokenizer (and transformers' import, seconds) loads while shards travel.
        tok: list[Any] = []
        loader = threading.Thread(target=lambda: tok.append(_load_tokenizer(model_path)), daemon=True)
        loader.start()
        try:
            self._loop.call(self._connect_all(), 60)
            self.plan = self._make_plan(model)
            self.timings["plan_s"] = time.monotonic() - t0
            self._export(model_path, model.num_layers)
            t = time.monotonic()
            self._loop.call(self._send_all(), None)
            self.timings["transfer_s"] = time.monotonic() - t
            t = time.monotonic()
            self._loop.call(self._load_all(), None)
            loader.join()
            self.engine = self._wire(model_path, tok[0] if tok else None)
            if self.cfg.recover:
                self.provider = FleetRingProvider(self)
                self.engine.enable_recovery(self.provider)
            self.timings["load_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self._watch = self._loop.submit(self._watch_events())
        self.engine.fleet = self
        self.timings["launch_s"] = time.monotonic() - t0
        return self.engine

    async def _connect_all(self) -> None:
        async def one(peer: Peer) -> None:
            client = AgentClient(self.keys, peer.endpoint(), peer.info.public_key, timeout=15.0)
            try:
                await client.async_connect()
            except NotPaired:
                client.close()
                raise NotPaired(f"{peer.info.hostname} ({peer.info.fingerprint}) has not paired with this "
                                "controller: pair first (`flotilla agent pair --accept CODE` on it)") from None
            except BaseException:
                client.close()
                raise
            self._clients[peer.node_id] = client
            self.statuses[peer.node_id] = await client.status()

        results = await asyncio.gather(*(one(p) for p in self.peers.values()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    # the plan (_make_plan, _check_user_plan, _adopt): LaunchPlanning, engine/fleet/launch_plan.py

    def _export(self, model_path: Path, total: int) -> None:
        import openvino as ov

        from engine.fleet.bundle import cached_bundle
        from engine.models.demo import cache_root
        from engine.shards.export import MANIFEST, ensure_shard, shard_cache_key, shard_cache_root

        from engine.models.fingerprint import model_fingerprint
        fp = model_fingerprint(model_path)
        for st in self.stages:  # ranges and precision from the plan, one range at a time
            key = shard_cache_key(fp, st.start, st.end, self.precision, ov.get_version())
            cached = (shard_cache_root() / key / MANIFEST).exists()
            self._stage_step(st, "pack" if cached else "export", 0.0,
                             f"{'packing' if cached else 'exporting'} shard {st.index} (layers {st.start}–{st.end}, "
                             f"{self.precision})", st.index / len(self.stages))
            info = ensure_shard(model_path, st.start, st.end, num_layers_total=total, precision=self.precision)
            st.bundle, st.sha256 = cached_bundle(Path(info.path), cache_root() / "bundles")
            st.shard_path = Path(info.path)

    def _stage_step(self, st: _Stage, phase: str, fraction: float, message: str,
                    overall: float | None = None) -> None:
        """Report one stage's step: the line to the Progress callback (with `overall`, or the
        phase's fraction), its fields to on_stage."""
        self.progress(message, fraction if overall is None else overall)
        self.on_stage(StageProgress(st.index, phase, fraction, message))

    async def _send_all(self) -> None:
        # Each agent first says whether its disk can take its shard (PrepareRequest),
        # so a full disk is one line naming the peer before any chunk travels anywhere.
        _raise_refusals(await asyncio.gather(*(self._room_for(st) for st in self.stages), return_exceptions=True))
        await asyncio.gather(*(self._send_one(st) for st in self.stages))

    def _shard_id(self, st: _Stage) -> str:
        return f"{self.model_id[:80]}/L{st.start}-{st.end}"

    async def _room_for(self, st: _Stage) -> None:
        """Returns when st's agent has its shard or room for it; raises _refused(st, e) when not."""
        try:
            await self._clients[st.peer.node_id].prepare(self._shard_id(st), st.sha256, st.bundle.size)
        except AgentRefused as e:
            raise _refused(st, e, "prepare") from None

    async def _send_one(self, st: _Stage) -> None:
        client = self._clients[st.peer.node_id]
        size = st.bundle.size
        name = st.peer.info.hostname

        def shown(have: int, total: int) -> None:
            self._stage_step(st, "send", have / max(1, total),
                             f"sending shard {st.index} to {name}: {have / 1e6:.1f}/{total / 1e6:.1f} MB")

        try:
            last = await client.send_shard(st.bundle, self._shard_id(st), sha=st.sha256,
                                           chunk=self.cfg.chunk_bytes, progress=shown)
        except AgentRefused as e:  # the disk filled meanwhile (or a bad bundle): name the peer
            raise _refused(st, e, "prepare") from None
        if getattr(last, "cached", False):
            self._stage_step(st, "have", 1.0, f"shard {st.index}: {name} already has it")
        else:
            st.sent_bytes = size
            if not getattr(last, "complete", False):
                raise FleetError(f"sending shard {st.index} to {name} stopped at {last.have_bytes} bytes")

    async def _load_all(self) -> None:
        # Every agent answers (started or refused) before we report, so every refusing stage is named.
        _raise_refusals(await asyncio.gather(*(self._load_one(st) for st in self.stages), return_exceptions=True))

    async def _load_one(self, st: _Stage) -> None:
        # Every agent of the session may feed this worker (a recovery can put any of them next to it).
        ring = sorted({p.info.public_key for p in self.peers.values()})
        self._stage_step(st, "start", 0.0, f"starting stage {st.index} on {st.peer.info.hostname} ({st.device})")
        others = tuple(k for k in ring if k != st.peer.info.public_key)
        self._all.append(st)  # unloaded at stop, even when the load fails half-way
        try:
            reply = await self._clients[st.peer.node_id].load(
                st.sha256, st.device, 0, exact=self.cfg.exact, ring_keys=others, timeout=self.cfg.load_timeout_s,
                context_length=self.context_length or 0, streams=self.streams or 1, kv_precision=self.kv_precision)
        except AgentRefused as e:  # the worker would not fit, the owner is back...: name stage and peer
            raise _refused(st, e, "load") from None
        if not reply.data_port:
            raise FleetError(f"the worker on {st.peer.info.hostname} did not say which port it bound")
        st.data_port, st.pid = reply.data_port, reply.shard.pid
        st.proc = RemoteWorker(st.pid)

    def _wire(self, model_path: Path, tokenizer: Any = None) -> Any:
        from engine.pipeline.coordinator import PipelineConfig, PipelineEngine, StageLink

        for st in self.stages:
            st.link = StageLink(st.index, st.start, st.end, st.peer.endpoint(st.data_port), proc=st.proc,
                                pid=st.pid, server_key=st.peer.info.public_key)
        links = [st.link for st in self.stages]
        host = self.cfg.controller_host or local_address_toward(self.stages[0].peer.host)
        self._host = host
        pcfg = PipelineConfig(max_concurrent=self.streams, prefill_chunk=self.cfg.prefill_chunk,
                              context_length=self.context_length, return_bind=f"tcp://{host}:*",
                              ready_timeout_s=self.cfg.ready_timeout_s, device=self.stages[0].device,
                              curve=CurveEnd(self.keys), prompt_cache_exact=self.cfg.prompt_cache_exact)
        self.progress(f"wiring {len(links)} stages (shards compile on first use)", 0.0)
        return PipelineEngine(links, model_path, self.model_id, pcfg, on_close=self.stop, tokenizer=tokenizer)

    # -- events ------------------------------------------------------------------
    async def _watch_events(self) -> None:
        while not self._stopped:
            for nid, client in list(self._clients.items()):
                try:
                    ev = await client.next_event(0.05)
                except Exception:  # the channel is closing
                    ev = None
                if ev is not None:
                    self._on_agent_event(nid, ev)
            await asyncio.sleep(0.1)

    def _on_agent_event(self, node_id: str, ev: AgentEvent) -> None:
        ours = [st for st in self.stages if st.peer is not None and st.peer.node_id == node_id
                and (not ev.shards or st.sha256 in ev.shards)]
        if not ours:
            return  # not about our ring (e.g. a stage that was already replaced)
        for st in ours:
            what = {"yielding": "is yielding to its user", "yield": "yielded to its user"}.get(
                ev.event, "lost its shard worker")
            msg = (f"stage {st.index} (layers {st.start}–{st.end}) on {st.peer.info.hostname} {what}: "
                   f"{ev.detail or ev.event}")
            fe = FleetEvent(st.index, st.peer.info.hostname, node_id, ev, msg)
            self.events.append(fe)
            log.warning("fleet: %s", msg)
            for listener in list(self._listeners):
                try:
                    listener(fe)
                except Exception:
                    log.exception("fleet event listener failed")
            recovery = getattr(self.engine, "recovery", None)
            if recovery is not None and recovery.enabled:
                if ev.event == "yielding":  # hand over while it still serves
                    fut = self.engine.migrate_stage(st.index, f"{st.host} is needed by its user ({ev.detail})")
                    fut.add_done_callback(lambda f, m=msg: _log_migration(f, m))
                elif isinstance(st.proc, RemoteWorker) and st.proc.returncode is None:
                    st.proc.returncode = _exit_code(ev)  # the coordinator recovers at its next tick
            elif self.break_on_event and self.engine is not None:
                _break_engine(self.engine, f"{msg}; the pipeline stopped (recovery is off)")

    # -- teardown ----------------------------------------------------------------
    def stop(self) -> None:
        """Unload every worker we started and close the control channels. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop.on_loop_thread():  # engine.close() from an event listener
            threading.Thread(target=self._stop_now, name="flotilla-fleet-stop", daemon=True).start()
            return
        self._stop_now()

    def _stop_now(self) -> None:
        try:
            if self._watch is not None:
                try:
                    self._watch.result(2)
                except Exception:
                    self._watch.cancel()
            for st in self._all:
                if st.peer is None:
                    _stop_local(st.proc)
            if self._clients:
                self._loop.call(self._unload_all(), 30)
        except Exception as e:
            log.warning("fleet: stopping the workers: %s", e)
        finally:
            self._loop.stop(10)
            if self._local_dir is not None:
                import shutil

                shutil.rmtree(self._local_dir, ignore_errors=True)

    async def _unload_all(self) -> None:
        async def one(st: _Stage) -> None:
            await self._unload_one(st)

        await asyncio.gather(*(one(st) for st in self._all if st.peer is not None))
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    async def _unload_one(self, st: _Stage) -> None:
        client = self._clients.get(st.peer.node_id) if st.peer is not None else None
        if client is None or not st.data_port:
            return
        st.data_port = 0  # once
        try:
            await client.unload(st.sha256)
        except Exception as e:  # gone, or already stopped (a yield)
            log.info("fleet: unload on %s: %s", st.peer.info.hostname, e)

    def summary(self) -> dict:
        """Peers, plan and timings, as plain data."""
        return {
            "peers": [{"node_id": p.node_id, "host": p.info.hostname, "address": p.host,
                       "fingerprint": p.info.fingerprint, "left_out": self.left_out.get(p.node_id)}
                      for p in self.peers.values()],
            "plan": [{"stage": st.index, "peer": st.host, "node_id": st.peer.node_id if st.peer else None,
                      "device": st.device, "layers": [st.start, st.end], "data_port": st.data_port,
                      "shard_sha256": st.sha256, "sent_bytes": st.sent_bytes} for st in self.stages],
            "recoveries": [r.to_dict() for r in getattr(getattr(self.engine, "recovery", None), "records", [])],
            "predicted_tok_s": round(self.plan.predicted_tok_s, 1) if self.plan else None,
            "weights": plan_weights.plan_precision(self.plan) if self.plan else None,
            "context_length": self.plan.context_length if self.plan else None,
            "streams": self.plan.streams if self.plan else None,
            "user_plan": self.user_plan is not None,
            "timings_s": {k: round(v, 2) for k, v in self.timings.items()},
        }


def _exit_code(ev: AgentEvent) -> int:
    """The exit an agent reported, as a Popen returncode (a yield = SIGTERM)."""
    import signal

    if ev.event == "worker_exit":
        try:
            return int(ev.detail.rsplit(" ", 1)[-1])
        except ValueError:
            return 1
    return -int(signal.SIGTERM)


def _log_migration(fut: Any, msg: str) -> None:
    try:
        rec = fut.result()
        log.warning("fleet: %s: migrated in %.2f s", msg, rec.resume_s)
    except Exception as e:  # noqa: BLE001
        log.warning("fleet: %s: migration failed: %s", msg, e)


def _load_tokenizer(model_path: Path) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception:  # PipelineEngine tries again and reports it
        return None


def _break_engine(engine: Any, reason: str) -> None:
    """End every request of the engine (a PipelineEngine) with reason and refuse new ones."""
    if not engine.broken:
        engine.break_ring(reason)
    engine.wake()

"""FleetRingProvider: the coordinator's re-plan provider on a fleet, which puts a lost
stage's layers on a spare agent (or on this PC) and retires the old workers."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.fleet.client import FleetError
from engine.fleet.discovery import Peer
from engine.fleet.launch_errors import _one_line
from engine.fleet.launch_plan import peer_profile
from engine.fleet.refusal import StageRefused
from engine.fleet.ring_stage import _Stage, _stop_local
from engine.planner.plan import DeviceProfile, PeerProfile
from engine.shards import worker_process

if TYPE_CHECKING:
    from engine.fleet.session import FleetSession

log = logging.getLogger(__name__)


class FleetRingProvider:
    """The coordinator's re-plan provider on a fleet (engine/pipeline/recovery.py).

    replan(): each lost stage's layers go to the first spare agent (paired, in
    this session, not in the ring, not the one that lost it) that shares its PC
    right now and has room: its shard is sent (skipped when cached) and loaded
    exactly as at launch. When none can, and LaunchConfig.local_fallback
    allows, a local shard worker on this PC takes them (CURVE under this
    controller's key, which every agent's worker admits). Else
    RecoveryImpossible says why for each candidate. retire(): unload the old
    workers on their agents (a yielding agent may stop at once) / stop local
    ones; it does not wait (it runs on the coordinator thread)."""

    def __init__(self, session: FleetSession) -> None:
        self.session = session
        self.replacements: list[dict] = []  # what replan() did, for status and tests

    def replan(self, loss: Any) -> list[Any]:
        from engine.pipeline.recovery import RecoveryImpossible

        s = self.session
        if s._stopped:
            raise RecoveryImpossible("the fleet session is closed")
        by_link = {id(st.link): st for st in s._all if st.link is not None}
        ring = [by_link.get(id(link)) for link in loss.stages]
        if any(st is None for st in ring):
            raise RecoveryImpossible("the ring has stages this fleet session did not start")
        for i in loss.lost:
            t = time.monotonic()
            new = self._replace(ring, i)
            ring[i] = new
            self.replacements.append({"stage": i, "layers": [new.start, new.end], "host": new.host,
                                      "node_id": new.peer.node_id if new.peer else None,
                                      "sent_bytes": new.sent_bytes, "seconds": round(time.monotonic() - t, 3)})
        for k, st in enumerate(ring):
            st.index = k
        s.stages = ring
        return [st.link for st in ring]

    def retire(self, links: Any, reason: str) -> None:
        s = self.session
        gone = {id(link) for link in links}
        for st in s._all:
            if st.link is None or id(st.link) not in gone:
                continue
            if st.peer is None:
                threading.Thread(target=_stop_local, args=(st.proc,), daemon=True).start()
            elif not s._stopped:
                s._loop.submit(s._unload_one(st))

    # -- choosing and starting a replacement ------------------------------------
    def _replace(self, ring: list[_Stage], i: int) -> _Stage:
        from engine.pipeline.recovery import RecoveryImpossible

        s, old = self.session, ring[i]
        busy = {st.peer.node_id for k, st in enumerate(ring) if st.peer is not None and k != i}
        why: list[str] = []
        for peer in s.peers.values():
            name = peer.info.hostname
            if old.peer is not None and peer.node_id == old.peer.node_id:
                why.append(f"{name}: it lost the stage")
                continue
            if peer.node_id in busy:
                why.append(f"{name}: already hosts a stage")
                continue
            try:
                new = self._try_peer(ring, i, peer)
            except RecoveryImpossible as e:
                why.append(f"{name}: {e}")
                continue
            except StageRefused as e:  # the agent said why, in fields
                why.append(f"{name}: {'; '.join(r.why() for r in e.refusals)}")
                continue
            except Exception as e:  # noqa: BLE001 - next candidate
                log.warning("fleet: stage %d onto %s failed: %s", i, name, e)
                why.append(f"{name}: {_one_line(e)}")
                continue
            log.warning("fleet: layers %d–%d now on %s", new.start, new.end, name)
            return new
        if s.cfg.local_fallback:
            try:
                return self._start_local(old)
            except Exception as e:  # noqa: BLE001
                why.append(f"this PC: {_one_line(e)}")
        else:
            why.append("this PC: not allowed to host stages (local_fallback is off)")
        raise RecoveryImpossible(f"nothing can host layers {old.start}–{old.end} any more "
                                 f"({'; '.join(why) or 'no other peer'})")

    def _try_peer(self, ring: list[_Stage], i: int, peer: Peer) -> _Stage:
        from engine.planner.validate import validate_plan
        from engine.pipeline.recovery import RecoveryImpossible

        s, old = self.session, ring[i]
        client = s._clients.get(peer.node_id)
        if client is None:
            raise RecoveryImpossible("no control channel")
        status = s._loop.call(client.status(), 10)
        s.statuses[peer.node_id] = status
        if not status.sharing:
            raise RecoveryImpossible(f"not sharing now: {status.reason}")
        prof = peer_profile(peer, status)
        kinds = [d for kind in s.cfg.device_preference for d in prof.devices if d.kind == kind]
        if not kinds:
            raise RecoveryImpossible(f"offers no device of kinds {', '.join(s.cfg.device_preference)}")
        # Fit: the ring with this peer in place of the lost stage (the others assumed to fit, as they run).
        profiles, specs = [prof], []
        for k, st in enumerate(ring):
            if k == i:
                specs.append((prof.peer_id, kinds[0].name, st.start, st.end))
            else:
                pid = f"ring-{k}"
                profiles.append(PeerProfile(pid, pid, (DeviceProfile("CPU", "CPU"),), 1 << 50))
                specs.append((pid, "CPU", st.start, st.end))
        issues = validate_plan(specs, s._plan_model, profiles, s._plan_request)
        if issues:
            raise RecoveryImpossible("; ".join(x.message for x in issues))
        new = _Stage(i, peer, kinds[0].name, old.start, old.end, old.bundle, old.sha256,
                     shard_path=old.shard_path)
        s._loop.call(s._send_one(new), None)
        s._loop.call(s._load_one(new), s.cfg.load_timeout_s + 10)
        from engine.pipeline.coordinator import StageLink

        new.link = StageLink(i, new.start, new.end, peer.endpoint(new.data_port), proc=new.proc, pid=new.pid,
                             server_key=peer.info.public_key)
        return new

    def _start_local(self, old: _Stage) -> _Stage:
        """A shard worker on this PC, started the way the local runner starts them."""
        from engine.transport.curve_data import write_curve_file
        from engine.fleet.paths import ensure_private_dir, write_private
        from engine.models.demo import cache_root
        from engine.pipeline.coordinator import StageLink
        s = self.session
        if old.shard_path is None:
            raise FleetError("the shard is not on this PC")
        if s._local_dir is None:
            s._local_dir = ensure_private_dir(Path(tempfile.mkdtemp(prefix="flotilla-fleet-local-")))
            write_private(s._local_dir / "node.secret", s.keys.secret + "\n")
        # It feeds / is fed by agents' workers: admit every agent of the session (and us).
        allow = [p.info.public_key for p in s.peers.values()] + [s.keys.public]
        n = len(s._all)
        curve = write_curve_file(s._local_dir / f"local-{n}.curve.json", s._local_dir / "node.secret", allow)
        cmd = worker_process.worker_command(old.shard_path, f"tcp://{s._host}:*", f"stage {old.index} (this PC)",
                                            "CPU", cache_root() / "ov-blobs", exact=s.cfg.exact,
                                            kv_precision=s.kv_precision, curve=curve)
        log_path = s._local_dir / f"local-{n}.log"
        proc = worker_process.spawn(cmd, log_path)
        new = _Stage(old.index, None, "CPU", old.start, old.end, old.bundle, old.sha256,
                     shard_path=old.shard_path, proc=proc, pid=proc.pid)
        s._all.append(new)
        try:
            new.endpoint = worker_process.read_bound(proc, f"the local worker of layers {old.start}–{old.end}",
                                                     log_path, s.cfg.load_timeout_s)
        except worker_process.WorkerStartError as e:
            _stop_local(proc)
            raise FleetError(f"the local worker did not start: {e}") from None
        log.warning("fleet: layers %d–%d now on this PC (pid %d)", old.start, old.end, proc.pid)
        new.link = StageLink(old.index, old.start, old.end, new.endpoint, proc=proc, log_path=log_path,
                             server_key=s.keys.public)
        return new

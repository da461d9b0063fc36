"""RecoveryReplay: every stream rebuilt on a recovered ring (recovery step 5, replay).

A mixin of RingRecovery (recovery.py): new stream ids for every admitted stream,
prompt + answer so far prefilled again a chunk at a time, and the coordinator's
send/result hooks that pause the ring and consume the replay's chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.protocol.pipeline import MAX_FREE, StageFree, StageStep

if TYPE_CHECKING:
    from engine.pipeline.coordinator_streams import _Flight
    from engine.pipeline.recovery import RecoveryRecord


@dataclass
class _Replay:
    ids: list[int]  # prompt + generated tokens to prefill again
    pos: int = 0  # how many are in the new KV state


class RecoveryReplay:
    """Replaying every stream (a RingRecovery mixin)."""

    def _replay_all(self, rec: RecoveryRecord) -> None:
        """New stream ids for every admitted stream; free the old ones everywhere."""
        e = self.engine
        active: dict = getattr(e, "_active", {})
        flights = list(active.values())
        old_ids = [f.stream_id for f in flights] + list(getattr(e, "_to_free", []))
        parked = getattr(e, "parked", None)
        old_ids += parked.clear() if parked is not None else []  # their KV is gone with the lost stage
        e._to_free = []
        for k in range(0, len(old_ids), MAX_FREE):
            msg = StageFree(tuple(old_ids[k:k + MAX_FREE]))
            for i in range(len(e.stages)):
                e.send_to_stage(i, msg)
        active.clear()
        self._replays.clear()
        self._resuming = set()
        for f in flights:
            reset_flight(f, f"s{next(e._ids)}")
            gen = f.gen
            if gen.output_ids:  # rebuild prompt + answer so far, then the next token comes back
                self._replays[f.stream_id] = _Replay(list(gen.prompt_ids) + list(gen.output_ids))
                rec.replayed_tokens += len(gen.prompt_ids) + len(gen.output_ids)
            else:  # was still reading its prompt: read it again
                gen.prefilled = 0
                gen.pending = None
                rec.replayed_tokens += len(gen.prompt_ids)
            active[f.stream_id] = f
            self._resuming.add(f.stream_id)
        rec.streams = len(flights)
        self._check_resumed()

    # -- coordinator thread: the send/result hooks ---------------------------------
    def hold_send(self, f: "_Flight") -> bool:
        """True when the step must not go out the usual way (paused, or replay sent here)."""
        if self.paused:
            return True
        r = self._replays.get(f.stream_id)
        if r is None:
            return False
        gen = f.gen
        ids = r.ids[r.pos:r.pos + gen.chunk]
        final = r.pos + len(ids) == len(r.ids)
        step = StageStep(f.stream_id, f.seq, f.past, reset=f.past == 0, want_token=final,
                         want_logits=final and f.sample)
        f.in_flight, f.sent_at = len(ids), time.perf_counter()
        self.engine.send_to_stage(0, step, [np.array([ids], np.int64)])  # token ids [1, n]
        return True

    def take_result(self, active: dict, msg: Any) -> bool:
        """True when a StageResult is consumed here (dropped while paused, or a replay chunk)."""
        if self.paused:
            return True
        f = active.get(msg.stream_id)
        if f is None or not f.in_flight or msg.seq != f.seq:
            return False
        self._stalls = 0
        r = self._replays.get(msg.stream_id)
        if r is None:
            if msg.stream_id in self._resuming and msg.token is not None:
                self._resuming.discard(msg.stream_id)
            return False
        n = f.in_flight
        r.pos += n
        if r.pos < len(r.ids):  # an intermediate replay chunk: nothing for the user
            f.seq += 1
            f.past += n
            f.in_flight = 0
            self.engine.stats.steps += 1
            return True
        del self._replays[msg.stream_id]  # the last chunk: its token is the next one of the answer
        self._resuming.discard(msg.stream_id)
        return False


def reset_flight(f: Any, stream_id: str) -> None:
    """A flight as if just admitted, keeping its Generation (prompt, answer so far, sampler)."""
    f.stream_id = stream_id
    f.seq = 0
    f.past = 0
    f.keep = None  # a fresh stream: nothing parked to trim
    f.in_flight = 0
    f.sent_at = 0.0
    spec = getattr(f, "spec", None)  # speculative decoding (engine/pipeline/speculative.py)
    if spec is not None:  # it re-syncs itself and goes on: new KV = prompt + answer, nothing hidden
        spec.on_ring_reset(f)

"""Schedulers: Bevy and the baselines, over the same model, cache, fetcher and steps.

Every scheduler moves *sequences* (one per request) through passes: a pass
feeds some tokens (a prompt chunk, or the last sampled token) through every
layer and ends with the logits of the last position, handed to the owner's
`on_logits` callback, which returns the next tokens to feed (or None: done).
All of them compute with the same batched steps (model.py): the rows of the
requests that are at a layer together are attended and routed in one call,
and each expert is applied once to all rows that wait for it.

* "bevy" (BevyScheduler): no barrier between requests. Each round: requests
  that start a pass enter layer 0 as one batch; for every (layer, expert) some
  request waits for: resident -> one group (all waiting rows, across batches)
  computed now; missing -> the fetcher is asked for exactly that expert,
  prioritised by how many requests wait for it -- no prediction. A request
  leaves a layer when its last expert was applied; the requests that leave
  layer L in the same round enter layer L+1 as one batch, while others still
  wait for their experts: a request that is ready runs ahead instead of
  waiting for a lockstep. Nothing waits to form big groups: with few requests
  ready they run at once, with many the batches and groups grow by themselves
  (self-balancing). Fetch threads read while this thread computes, so compute
  overlaps I/O.
* "on_demand" (lockstep, llama.cpp-style): all sequences advance layer by
  layer together; at each layer the missing experts are read (in parallel,
  the same fetcher) while the batch waits; resident ones are computed while
  the reads run, and each read expert as soon as it lands.
* "prefetch" (lockstep + prediction, mixtral-offloading / ProMoE-style): as
  on_demand, but at layer L the router of layer L+1 is applied to layer L's
  hidden state and the experts it predicts are fetched ahead (behind L's
  misses in the queue), so they load during layer L.
* "resident": on_demand with every expert preloaded (the upper bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.moe.cache import ExpertCache
from engine.moe.fetcher import Fetcher
from engine.moe.model import Batch, MoEModel, SeqState
from engine.moe.store import Key

SCHEDULERS = ("bevy", "on_demand", "prefetch", "resident")
NOW = 1e12  # fetch priority of experts a lockstep batch is blocked on


@dataclass(eq=False)
class Seq:
    sid: str  # request id
    on_logits: Callable[["Seq", torch.Tensor], list[int] | None]  # -> next tokens, or None when done
    on_error: Callable[["Seq", BaseException], None]  # the request failed (e.g. a corrupted expert)
    feed: list[int]  # tokens not yet run through the model
    state: SeqState | None = None  # its place in the model, set by the scheduler
    chunk: int = 512  # tokens per pass (long prompts take several)
    layer: int = -1  # layer the current pass is at (-1: between passes)


@dataclass
class SchedStats:
    passes: int = 0  # request passes finished (one per token after the prompt)
    tokens: int = 0  # tokens run through the model (prompt + generated)
    groups: int = 0  # expert computations (one per (layer, expert) group)
    rows: int = 0  # token rows computed by experts
    batches: int = 0  # attention calls (one per batch and layer)
    batch_rows: int = 0  # rows over all attention calls
    compute_s: float = 0.0  # time this thread spent computing
    wait_s: float = 0.0  # time this thread spent blocked on fetches
    group_sizes: list[int] = field(default_factory=list)  # requests per group (sampled)


def _alive(st: SeqState) -> bool:
    return st.slot >= 0


class Scheduler:
    """What the schedulers share: the sequences, and the pass / layer / expert steps."""

    name = "base"

    def __init__(self, model: MoEModel, cache: ExpertCache, fetcher: Fetcher) -> None:
        self.model = model
        self.cache = cache
        self.fetcher = fetcher
        self.seqs: dict[str, Seq] = {}
        self._owner: dict[int, Seq] = {}  # id(state) -> its sequence
        self.stats = SchedStats()

    def add(self, seq: Seq) -> None:
        seq.state = self.model.new_state()
        self._owner[id(seq.state)] = seq
        self.seqs[seq.sid] = seq

    def remove(self, sid: str) -> None:
        seq = self.seqs.pop(sid, None)
        if seq is not None:  # its rows still in a batch are dropped when the batch moves on
            self._owner.pop(id(seq.state), None)
            self.model.free_state(seq.state)

    @property
    def busy(self) -> bool:
        return bool(self.seqs)

    def tick(self) -> None:
        raise NotImplementedError

    # -- shared steps ------------------------------------------------------------------
    def _start(self, seqs: list[Seq]) -> Batch | None:
        """The next pass of each of `seqs`, as one batch, routed to its first MoE layer."""
        ids = []
        for s in seqs:
            take, s.feed = s.feed[:s.chunk], s.feed[s.chunk:]
            ids.append(take)
            s.layer = 0
        return self._route(self.model.start([s.state for s in seqs], ids))

    def _route(self, b: Batch) -> Batch | None:
        """Enter layers from b.layer until one needs routed experts (b, experts
        chosen), or the pass ends (None; logits handed over)."""
        m = self.model
        while b.layer < m.num_layers:
            self.stats.batches += 1
            self.stats.batch_rows += len(b.x)
            if m.attend(b):
                keys = [(b.layer, e) for e, (_r, _f, who) in b.groups.items() for _ in who]
                self.cache.demand_many(keys)  # one demand per (request, expert)
                for st in b.states:
                    self._owner[id(st)].layer = b.layer
                return b
            b.layer += 1  # a dense layer: its MLP is done
        self._end_pass(b)
        return None

    def _end_pass(self, b: Batch) -> None:
        seqs = [self._owner[id(st)] for st in b.states]
        want = [i for i, s in enumerate(seqs) if not s.feed]  # more prompt to prefill: no logits yet
        logits = self.model.head(b, want)
        self.stats.passes += len(seqs)
        self.stats.tokens += sum(b.ns)
        for s in seqs:
            s.layer = -1
        for j, i in enumerate(want):
            seq = seqs[i]
            try:
                nxt = seq.on_logits(seq, logits[j])
            except BaseException as e:  # the owner's failure ends this request only
                self._fail(seq, e)
                continue
            if nxt is None:
                self.remove(seq.sid)
            else:
                seq.feed = list(nxt)

    def _next(self, parts: list[tuple[Batch, list[int]]]) -> Batch | None:
        """Requests parts[j][1] of batch parts[j][0] (all at one layer, all experts applied)
        move on together: one batch at the next layer, routed."""
        layer = parts[0][0].layer + 1
        return self._route(self.model.advance(layer, parts))

    def _apply(self, key: Key, views: tuple, batches: list[Batch]) -> None:
        self.model.apply_expert(key[1], views, batches)
        self.stats.groups += 1
        n = sum(len(b.groups[key[1]][2]) for b in batches)
        self.stats.rows += sum(len(b.groups[key[1]][0]) for b in batches)
        if len(self.stats.group_sizes) < 100_000:
            self.stats.group_sizes.append(n)

    def _fail(self, seq: Seq, err: BaseException) -> None:
        if seq.sid in self.seqs:
            self.remove(seq.sid)
            seq.on_error(seq, err)

    def _check_errors(self, key: Key, batches: list[Batch]) -> bool:
        """The fetch of `key` failed: end every request waiting for it."""
        err = self.fetcher.errors.get(key)
        if err is None:
            return False
        for b in batches:
            for i in b.groups[key[1]][2]:
                st = b.states[i]
                if _alive(st):
                    self._fail(self._owner[id(st)], err)
        return True

    @staticmethod
    def _needed(b: Batch, e: int) -> int:
        """Live requests of b that wait for expert e."""
        return sum(1 for i in b.groups[e][2] if _alive(b.states[i]))


class LockstepScheduler(Scheduler):
    """on_demand / prefetch / resident: every sequence at the same layer."""

    def __init__(self, model: MoEModel, cache: ExpertCache, fetcher: Fetcher, mode: str) -> None:
        super().__init__(model, cache, fetcher)
        self.mode = mode
        self.name = mode

    def tick(self) -> None:
        seqs = [s for s in self.seqs.values() if s.feed]
        if not seqs:
            return
        t0 = time.perf_counter()
        wait0 = self.stats.wait_s
        b = self._start(seqs)
        while b is not None:
            nxt = b.layer + 1
            if self.mode == "prefetch" and nxt in self.model.moe_layers:
                self._prefetch(nxt, b.h)
            self._serve(b)
            live = [i for i, st in enumerate(b.states) if _alive(st)]
            if not live:
                break
            b = self._next([(b, live)])
        self.stats.compute_s += (time.perf_counter() - t0) - (self.stats.wait_s - wait0)

    def _prefetch(self, layer: int, h: torch.Tensor) -> None:
        """Guess layer's experts from this layer's hidden state h [N, H]; fetch them ahead (unheld)."""
        for e in sorted(self.model.predict(layer, h)):
            if not self.cache.resident((layer, e)):
                self.fetcher.request((layer, e), priority=0.0, hold=False)

    def _serve(self, b: Batch) -> None:
        """Compute every needed expert of b's layer; block on the missing ones."""
        layer = b.layer
        resident: list[tuple[Key, tuple]] = []
        missing: set[Key] = set()
        for e in sorted(b.groups):
            if not self._needed(b, e):
                continue
            key = (layer, e)
            views = self.cache.pin(key)
            if views is None:
                missing.add(key)
            else:
                resident.append((key, views))
        for key in sorted(missing):  # ask first: the reads run while the resident ones compute
            self.fetcher.request(key, priority=NOW, hold=True)
        for key, views in resident:
            self._apply(key, views, [b])
            self.cache.unpin(key)
        held: set[Key] = set()  # arrived for us, pinned once, not used yet
        while missing:
            t = time.perf_counter()
            held |= set(self.fetcher.take_arrived(wait_s=0.05))
            self.stats.wait_s += time.perf_counter() - t
            for key in sorted(missing):
                if self._check_errors(key, [b]) or not self._needed(b, key[1]):
                    missing.discard(key)
                    continue
                views = self.cache.pin(key)  # resident: a held arrival, or landed unheld (prefetch)
                if views is None:
                    if not self.fetcher.pending(key):  # evicted before use: ask again
                        self.fetcher.request(key, priority=NOW, hold=True)
                    continue
                self._apply(key, views, [b])
                self.cache.unpin(key)
                missing.discard(key)
            for key in held - missing:  # used (or no longer wanted): drop the arrival pin
                self.cache.unpin(key)
            held &= missing


class BevyScheduler(Scheduler):
    """Requests run ahead when their experts are resident; the rest wait for
    exactly the experts they need."""

    name = "bevy"

    def __init__(self, model: MoEModel, cache: ExpertCache, fetcher: Fetcher) -> None:
        super().__init__(model, cache, fetcher)
        self._held: set[Key] = set()  # arrived for waiters, pinned once, not used yet
        self._batches: list[Batch] = []  # batches waiting at some layer for experts

    def tick(self) -> None:
        t0 = time.perf_counter()
        fresh = [s for s in self.seqs.values() if s.layer < 0 and s.feed]  # admitted, or a next token
        if fresh:
            b = self._start(fresh)
            if b is not None:
                self._batches.append(b)
        # Who waits for what: (layer, expert) -> batches, and how many requests.
        waiting: dict[Key, list[Batch]] = {}
        count: dict[Key, int] = {}
        for b in self._batches:
            for e in b.todo:
                n = self._needed(b, e)
                if n:
                    key = (b.layer, e)
                    waiting.setdefault(key, []).append(b)
                    count[key] = count.get(key, 0) + n
        self._held |= set(self.fetcher.take_arrived())
        ready: list[tuple[Key, tuple, list[Batch]]] = []
        for key, group in waiting.items():
            if self._check_errors(key, group):
                continue
            views = self.cache.pin(key)
            if views is not None:
                ready.append((key, views, group))
            else:
                # Priority: requests blocked on it; among equals the fetcher keeps
                # first-asked-first-served, so no request starves.
                self.fetcher.request(key, priority=float(count[key]), hold=True)
        for key in [k for k in self._held if k not in waiting]:  # waiters gone (cancelled, failed)
            self._held.discard(key)
            self.cache.unpin(key)
        if not ready:
            self._drop_finished()
            self.stats.compute_s += time.perf_counter() - t0
            if self.seqs:
                t = time.perf_counter()
                self._held |= set(self.fetcher.take_arrived(wait_s=0.05))
                self.stats.wait_s += time.perf_counter() - t
            return
        ready.sort(key=lambda r: -count[r[0]])  # biggest groups first: they free the most requests
        for key, views, group in ready:
            self._apply(key, views, group)
            self.cache.unpin(key)
            if key in self._held:
                self._held.discard(key)
                self.cache.unpin(key)
        # Requests whose experts are all applied leave their layer; those leaving the
        # same layer now enter the next one as one batch.
        moving: dict[int, list[tuple[Batch, list[int]]]] = {}
        for b in self._batches:
            idx = [i for i, st in enumerate(b.states) if b.left[i] == 0 and _alive(st)]
            if idx:
                moving.setdefault(b.layer, []).append((b, idx))
                for i in idx:
                    b.left[i] = -1  # moved on
        for layer in sorted(moving, reverse=True):  # the furthest first
            nb = self._next(moving[layer])
            if nb is not None:
                self._batches.append(nb)
        self._drop_finished()
        self.stats.compute_s += time.perf_counter() - t0

    def _drop_finished(self) -> None:
        self._batches = [b for b in self._batches
                         if any(b.left[i] >= 0 and _alive(st) for i, st in enumerate(b.states))]


def make_scheduler(kind: str, model: MoEModel, cache: ExpertCache, fetcher: Fetcher) -> Scheduler:
    if kind == "bevy":
        return BevyScheduler(model, cache, fetcher)
    if kind in ("on_demand", "prefetch", "resident"):
        return LockstepScheduler(model, cache, fetcher, kind)
    raise ValueError(f"unknown scheduler {kind!r}; choose one of {', '.join(SCHEDULERS)}")

"""Schedulers: Bevy and the baselines, over the same model, cache, fetcher and steps.

Every scheduler moves *sequences* (one per request) through passes: a pass
feeds some tokens (a prompt chunk, or the last sampled token) through every
layer and ends with the logits of the last position, handed to the owner's
`on_logits` callback, which returns the next tokens to feed (or None: done).
All of them compute with the same batched steps (model.py): the rows of the
requests that are at a layer together are attended and routed in one call,
and each expert is applied once to all rows that wait for it.

* "bevy" (BevyScheduler): no barrier between requests. Each round: requests
  whose selected experts are all resident run now, grouped per expert (one
  matmul set for all their rows, across batches); requests with missing
  experts wait while exactly those experts are fetched -- no prediction --
  prioritised by how close their waiters are to running. If no request is
  complete, the resident experts of waiting ones are applied meanwhile.
  Requests done with a layer line up for the next; when no expert work is
  ready, a lined-up group enters its next layer as one batch once no request
  of its pass is behind it, or at once (the biggest) when the disk has
  nothing to read (entering_now: the wave stays whole, and pays each layer's
  attention and the head once, while the disk is busy; it runs ahead when the
  disk would idle). Groups entering a MoE layer go before one whose pass ends
  (the head reads nothing), and while the disk has nothing to read they enter
  before any ready expert work, so that their misses are read meanwhile.
  Within a layer no request waits for another's experts.
  Fetch threads read while this thread computes. While one wave leaves both
  the disk and the compute waiting on each other for longer than a part of a
  second head and attention would cost, and the cache holds two layers' worth
  of the experts the requests pick, the requests move as two waves that do not
  wait for each other (two_waves, wave_count): one wave's reads fill the
  moments the other computes a layer's last experts, attends the next layer or
  runs the head, when it has nothing to read itself.
* "bevy_guess" (an ablation, not a listed scheduler): Bevy whose disk reads
  guesses when it would idle: each batch that enters a layer applies the next
  MoE layer's router to its hidden state and asks for the experts it picks as
  idle-fill reads (fetcher.py: after every real miss, one at a time, replaced
  by the next batch's guesses); a batch at the last MoE layer, whose head
  follows, asks for the first MoE layer's likely experts (next_pass_guesses).
  A guess nobody used is counted (cache.stats.unasked_unused). Not Bevy's
  default: `bench moe` runs it beside Bevy (docs/moe.md has the sets).
* "bevy_one_wave", "bevy_two_waves" (ablations): Bevy whose requests always
  move as one wave (Bevy before its two waves), or always as two.
* "on_demand" (lockstep, llama.cpp-style): all sequences advance layer by
  layer together; at each layer the missing experts are read (in parallel,
  the same fetcher, a full disk queue) while the batch waits, then the
  layer's experts are computed.
* "prefetch" (lockstep + prediction, mixtral-offloading / ProMoE-style): as
  on_demand, but at layer L the router of layer L+1 is applied to layer L's
  hidden state and the experts it predicts are fetched ahead (behind L's
  misses in the queue), so they load during layer L.
* "resident": on_demand with every expert preloaded (the upper bound).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.moe.cache import ExpertCache
from engine.moe.fetcher import Fetcher
from engine.moe.model import Batch, MoEModel, SeqState
from engine.moe.store import Key

SCHEDULERS = ("bevy", "on_demand", "prefetch", "resident")
# on_demand computing each expert as it lands; Bevy reading guesses when the disk would idle; Bevy
# moving its requests always as one wave, or always as two (docs/moe.md)
ABLATIONS = ("on_demand_overlap", "bevy_guess", "bevy_one_wave", "bevy_two_waves")
NOW = 1e12  # fetch priority of experts a lockstep batch is blocked on
# What a scheduler can be doing, for the fetcher's idle time by phase (bench moe reports it):
# attending a layer and routing, computing experts, the LM head, the owner's sampling,
# waiting for a read, its own bookkeeping, and (outside tick) the engine loop.
PHASES = ("attention", "experts", "head", "sampling", "waiting", "scheduling", "engine")


@dataclass(eq=False)
class Seq:
    sid: str  # request id
    on_logits: Callable[["Seq", torch.Tensor], list[int] | None]  # -> next tokens, or None when done
    on_error: Callable[["Seq", BaseException], None]  # the request failed (e.g. a corrupted expert)
    feed: list[int]  # tokens not yet run through the model
    state: SeqState | None = None  # its place in the model, set by the scheduler
    chunk: int = 512  # tokens per pass (long prompts take several)
    layer: int = -1  # layer the current pass is at (-1: between passes)
    wave: int = 0  # which of Bevy's waves it moves with


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
    phase_s: dict[str, float] = field(default_factory=dict)  # time in each of PHASES (nested ones overlap)
    two_wave_passes: int = 0  # request passes Bevy started while it moved two waves


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
        """Take a request in: a KV slot, and of its prompt only what the slot does not hold yet
        (prompt caching: seq.state.past ids are cached)."""
        seq.state = self.model.new_state(seq.feed)
        del seq.feed[:seq.state.past]
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
            with self._phase("attention"):
                routed = m.attend(b)
            if routed:
                keys = [(b.layer, e) for e, by in b.route.items() for _ in by]
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
        with self._phase("head"):
            logits = self.model.head(b, want)
        self.stats.passes += len(seqs)
        self.stats.tokens += sum(b.ns)
        for s in seqs:
            s.layer = -1
        for j, i in enumerate(want):
            seq = seqs[i]
            try:
                with self._phase("sampling"):
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

    def _apply(self, key: Key, views: tuple, parts: list[tuple[Batch, list[int]]]) -> None:
        """Expert `key` on requests parts[j][1] of batch parts[j][0]."""
        with self._phase("experts"):
            self.model.apply_expert(key[1], views, parts)
        self.stats.groups += 1
        self.stats.rows += sum(len(b.route[key[1]][i][0]) for b, who in parts for i in who)
        if len(self.stats.group_sizes) < 100_000:
            self.stats.group_sizes.append(sum(len(who) for _b, who in parts))

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Tell the fetcher what this thread does meanwhile (its idle time by phase); time it."""
        prev = self.fetcher.phase(name)
        t = time.perf_counter()
        try:
            yield
        finally:
            self.stats.phase_s[name] = self.stats.phase_s.get(name, 0.0) + time.perf_counter() - t
            self.fetcher.phase(prev)

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
            for i in self._waiters(b, key[1]):
                self._fail(self._owner[id(b.states[i])], err)
        return True

    def _plan(self, wanted: set[Key]) -> None:
        """Tell the cache where the requests are (its eviction order, see cache.py)."""
        n = self.model.num_layers
        at = {(0, False) if s.layer < 0 else (s.layer, True) for s in self.seqs.values()}
        dist = {}
        for layer in self.model.moe_layers:
            d = n
            for p, routed in at:
                k = layer - p
                if k < 0 or (k == 0 and routed):  # passed (or routed) already: next pass
                    k += n
                d = min(d, k)
            dist[layer] = d
        self.cache.plan(dist, wanted)

    @staticmethod
    def _waiters(b: Batch, e: int) -> list[int]:
        """Requests of b (alive, still at its layer) that wait for expert e."""
        return [i for i in b.route.get(e, ()) if e in b.needs[i] and not b.moved[i] and _alive(b.states[i])]


class LockstepScheduler(Scheduler):
    """on_demand / prefetch / resident: every sequence at the same layer."""

    def __init__(self, model: MoEModel, cache: ExpertCache, fetcher: Fetcher, mode: str,
                 overlap: bool = False) -> None:
        super().__init__(model, cache, fetcher)
        self.mode = mode
        self.name = mode
        self.overlap = overlap  # compute each expert as it lands instead of after the layer's reads

    def tick(self) -> None:
        seqs = [s for s in self.seqs.values() if s.feed]
        if not seqs:
            return
        with self._phase("scheduling"):
            self._pass(seqs)

    def _pass(self, seqs: list[Seq]) -> None:
        """One pass of `seqs`, layer by layer, each layer's experts read before it computes."""
        t0 = time.perf_counter()
        wait0 = self.stats.wait_s
        b = self._start(seqs)
        while b is not None:
            nxt = b.layer + 1
            if self.mode == "prefetch" and nxt in self.model.moe_layers:
                self._prefetch(nxt, b.h)
            self._plan({(b.layer, e) for e in b.groups})
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
        """The layer's missing experts are read (in parallel) while the batch waits,
        then every needed expert of the layer is computed (llama.cpp-style: fetch
        synchronously, then compute). With overlap=True each expert is computed as
        soon as it is resident instead (a stronger variant, measured in docs/moe.md)."""
        layer = b.layer
        ready: list[tuple[Key, tuple]] = []  # pinned, to compute
        missing: set[Key] = set()
        for e in sorted(b.groups):
            if not self._waiters(b, e):
                continue
            key = (layer, e)
            views = self.cache.pin(key)
            if views is None:
                missing.add(key)
            else:
                ready.append((key, views))
        # Keys that will land held: each brings one pin, released once it was reported.
        expect = {key for key in sorted(missing) if self.fetcher.request(key, priority=NOW, hold=True)}
        # A cache smaller than the layer's experts cannot hold them all at once: then
        # each is computed as it lands (and unpinned) whatever the mode.
        overlap = self.overlap or len(ready) + len(missing) > self.cache.capacity
        if overlap:
            self._compute(b, ready)
        held: set[Key] = set()  # arrived for us, pinned once, not pinned by us yet
        seen: set[Key] = set()  # every arrival reported
        while missing or expect - seen:
            t = time.perf_counter()
            with self._phase("waiting"):
                got = set(self.fetcher.take_arrived(wait_s=0.05))
            self.stats.wait_s += time.perf_counter() - t
            held |= got
            seen |= got
            expect -= set(self.fetcher.errors)
            for key in sorted(missing):
                if self._check_errors(key, [b]) or not self._waiters(b, key[1]):
                    missing.discard(key)
                    continue
                views = self.cache.pin(key)  # resident: a held arrival, or landed unheld (prefetch)
                if views is None:
                    if not self.fetcher.pending(key) and self.fetcher.request(key, priority=NOW, hold=True):
                        expect.add(key)  # evicted before use (unheld prefetch): asked again
                    continue
                ready.append((key, views))
                missing.discard(key)
            for key in held - missing:  # pinned into `ready` (or not wanted): drop the arrival pin
                self.cache.unpin(key)
            held &= missing
            if overlap:
                self._compute(b, ready)
        self._compute(b, ready)

    def _compute(self, b: Batch, ready: list[tuple[Key, tuple]]) -> None:
        """Apply the pinned experts `ready` to b and unpin them (the list is emptied)."""
        for key, views in ready:
            who = self._waiters(b, key[1])
            if who:
                self._apply(key, views, [(b, who)])
            self.cache.unpin(key)
        ready.clear()


class BevyScheduler(Scheduler):
    """Requests run ahead when their experts are resident; the rest wait for
    exactly the experts they need."""

    name = "bevy"

    def __init__(self, model: MoEModel, cache: ExpertCache, fetcher: Fetcher, guess: bool = False,
                 waves: int | None = None) -> None:
        super().__init__(model, cache, fetcher)
        self.guess = guess  # idle-fill reads of the next layer's guessed experts
        self.fixed_waves = waves  # None: one or two as the passes' costs say (_decide_waves); the ablations fix it
        self.waves = waves or 1  # waves in use now
        self._window = self._totals()  # wall, compute, disk-busy and split-cost seconds at the last decision
        self._prompt_fed = False  # a pass since then fed more than one token of a request
        self.name = "bevy_guess" if guess else {None: "bevy", 1: "bevy_one_wave", 2: "bevy_two_waves"}[waves]
        self._held: set[Key] = set()  # arrived for waiters, pinned once, waiters not all served yet
        self._batches: list[Batch] = []  # batches at some layer with requests waiting for experts
        self._asked: dict[Key, float] = {}  # fetches asked for, at which priority
        self._picks: dict[int, dict[int, int]] = {}  # layer -> expert -> requests that picked it (guesses)
        # Requests done with a layer, not yet attended at the next: layer -> [(batch, requests)].
        self._entering: dict[int, list[tuple[Batch, list[int]]]] = {}

    def add(self, seq: Seq) -> None:
        """A new request joins the smaller of the two waves (they move as one while
        self.waves is 1)."""
        sizes = [0, 0]
        for other in self.seqs.values():
            sizes[other.wave] += 1
        seq.wave = sizes.index(min(sizes))
        super().add(seq)

    def _wave(self, b: Batch) -> int:
        """The wave b moves with now: its first live request's (a batch started while Bevy
        moved one wave may hold requests of both; it moves whole until its pass ends)."""
        return next((self._seq_wave(self._owner[id(st)]) for st in b.states if id(st) in self._owner), 0)

    def _seq_wave(self, seq: Seq) -> int:
        """The wave seq moves with now (every request is wave 0 while Bevy moves one)."""
        return seq.wave if self.waves > 1 else 0

    def _totals(self) -> tuple[float, float, float, float]:
        """(wall, compute, disk busy, one wave's split cost: head + attention) seconds so far."""
        ph = self.stats.phase_s
        return (time.perf_counter(), self.stats.compute_s, self.fetcher.busy_time(),
                ph.get("head", 0.0) + ph.get("attention", 0.0))

    def _decide_waves(self) -> None:
        """One wave or two for the passes that start now, from what the last ones cost (a
        window with a prompt chunk in it says nothing of the answers' steps: kept as is)."""
        now = self._totals()
        wall, compute, busy, split = (a - b for a, b in zip(now, self._window))
        self._window, prompt = now, self._prompt_fed
        self._prompt_fed = False
        if self.fixed_waves is not None or prompt:
            return
        fits = wave_count(len(self.seqs), self.model.index.num_experts, self.model.top_k,
                          self.cache.capacity) >= 2
        self.waves = 2 if fits and two_waves(wall, compute, busy, split, self.waves) else 1

    def tick(self, rounds: int = 16) -> None:
        """Rounds until one has nothing to compute (then it waited for an expert to
        land), at most `rounds` so the engine loop admits and cancels often enough."""
        with self._phase("scheduling"):
            for _ in range(rounds):
                if not self._round():
                    return

    def _round(self) -> bool:
        """One round; False if there was nothing to compute (it waited for the disk)."""
        t0 = time.perf_counter()
        if self._entering and self.fetcher.idle():
            # the disk has nothing to read: a group that may enter a MoE layer does so before
            # any expert work, so that its misses are read while that work is computed
            self._enter(heads=False)
        # Who waits for what: (layer, expert) -> [(batch, requests)].
        waiting: dict[Key, list[tuple[Batch, list[int]]]] = {}
        for b in self._batches:
            for e in b.todo:
                who = self._waiters(b, e)
                if who:
                    waiting.setdefault((b.layer, e), []).append((b, who))
        self._arrivals(0.0)
        if self.fetcher.errors:
            for key in [k for k in waiting if self._check_errors(k, [b for b, _ in waiting[k]])]:
                del waiting[key]
        views = self.cache.pin_many(waiting)  # the resident ones, pinned for this round
        # Requests whose experts are all resident run now, grouped per expert; the others
        # wait for exactly their missing experts. When none is complete, the resident
        # experts of waiting requests are applied meanwhile (progress with a small cache,
        # and compute that would otherwise idle while the disk reads).
        missing_of: dict[tuple[int, int], int] = {}  # (id(batch), request) -> missing experts
        for b in self._batches:
            for i, need in enumerate(b.needs):
                if need and not b.moved[i] and _alive(b.states[i]):
                    missing_of[(id(b), i)] = sum(1 for e in need if (b.layer, e) not in views)
        complete = any(m == 0 for m in missing_of.values())
        ready: dict[Key, list[tuple[Batch, list[int]]]] = {}
        want: dict[Key, float] = {}  # missing expert -> requests it frees (1 / their missing count)
        for key, group in waiting.items():
            if key in self.fetcher.errors:
                continue
            for b, who in group:
                if key in views:
                    run = [i for i in who if not complete or missing_of.get((id(b), i)) == 0]
                    if run:
                        ready.setdefault(key, []).append((b, run))
                else:
                    want[key] = want.get(key, 0.0) + sum(1.0 / max(1, missing_of.get((id(b), i), 1))
                                                         for i in who)
        for key, pri in want.items():
            # Priority: how close to running the requests blocked on it are (a request
            # missing only this expert counts 1); among equals the fetcher keeps
            # first-asked-first-served, so no request starves.
            if self._asked.get(key, -1.0) < pri and self.fetcher.request(key, priority=pri, hold=True):
                self._asked[key] = pri  # it will land held and be reported (then forgotten)
        order = sorted(ready, key=lambda k: -sum(len(w) for _b, w in ready[k]))  # biggest groups first
        for key in order:
            self._apply(key, views[key], ready[key])
        self.cache.unpin_many(views)
        for key in [k for k in self._held if not any(self._waiters(b, k[1]) for b, _ in waiting.get(k, ()))]:
            self._held.discard(key)  # every waiter got it (or none is left): drop the arrival pin
            self.cache.unpin(key)
        # Requests with every expert applied leave their layer and line up for the next.
        for b in self._batches:
            idx = [i for i, st in enumerate(b.states) if not b.needs[i] and not b.moved[i] and _alive(st)]
            if idx:
                self._entering.setdefault(b.layer, []).append((b, idx))
                for i in idx:
                    b.moved[i] = True
        self._batches = [b for b in self._batches
                         if any(not m and _alive(st) for m, st in zip(b.moved, b.states))]
        if ready:  # expert work was done: look for more before attending the lined-up ones
            self.stats.compute_s += time.perf_counter() - t0
            return True
        # No expert work is ready: lined-up groups enter their next layer (entering_now).
        entering = self._enter(heads=True)
        starting = [s for s in self.seqs.values() if s.layer < 0 and s.feed]  # admitted, or a next token
        if starting:
            self._decide_waves()
        for wave in range(self.waves):
            fresh = [s for s in starting if self._seq_wave(s) == wave]
            self._prompt_fed |= any(len(s.feed) > 1 for s in fresh)
            if self.waves > 1:
                self.stats.two_wave_passes += len(fresh)
            if fresh:  # their next pass enters layer 0 as one batch (one per wave)
                entering[(wave, -1)] = []
                b = self._start(fresh)
                if b is not None:
                    self._batches.append(b)
                    self._guess(b)
        if entering:
            self._plan({(b.layer, e) for b in self._batches for e in b.todo})
        self.stats.compute_s += time.perf_counter() - t0
        if entering:
            return True
        if self.seqs:  # nothing to compute: wait for an expert to land
            t = time.perf_counter()
            self._arrivals(0.05)
            self.stats.wait_s += time.perf_counter() - t
        return False

    def _enter(self, heads: bool) -> dict:
        """Lined-up groups enter their next layer (entering_now); heads=False: only those
        entering a MoE layer, the ones whose pass ends (the head) stay lined up. The groups
        that entered, by (wave, layer done)."""
        entering, self._entering = self._take_entering()
        last = max(self.model.moe_layers, default=-1)
        if not heads:
            for (_w, layer), parts in [(k, p) for k, p in entering.items() if k[1] >= last]:
                self._entering.setdefault(layer, []).extend(parts)
                del entering[(_w, layer)]
        # A group entering a MoE layer first, the furthest first; one done with the last MoE
        # layer (its pass ends: the head, which reads nothing) after them: with two waves the
        # other wave's misses are asked for before the head runs, and read meanwhile.
        for key in sorted(entering, key=lambda k: (k[1] >= last, -k[1])):
            parts = [(b, [i for i in idx if _alive(b.states[i])]) for b, idx in entering[key]]
            parts = [(b, idx) for b, idx in parts if idx]
            if parts:
                nb = self._next(parts)
                if nb is not None:
                    self._batches.append(nb)
                    self._guess(nb)
        if entering and not heads:
            self._plan({(b.layer, e) for b in self._batches for e in b.todo})
        return entering

    def _guess(self, b: Batch) -> None:
        """The experts b will likely need at the next MoE layer (that layer's router on
        b's hidden state here; after the last one, the next pass's first: next_pass_guesses),
        asked for as idle-fill reads, the most picked first; they replace the guesses of the
        batch before, which it has passed or nearly."""
        if not self.guess or b.h is None:
            return
        picks = self._picks.setdefault(b.layer, {})
        for e, by in b.route.items():
            picks[e] = picks.get(e, 0) + len(by)
        nxt = min((layer for layer in self.model.moe_layers if layer > b.layer), default=None)
        self.fetcher.drop_fills()
        if nxt is None:  # the pass ends with the head: the disk would idle through it
            first = min(self.model.moe_layers)
            absent = [e for e in range(self.model.index.num_experts) if not self.cache.resident((first, e))]
            for e in next_pass_guesses(self._picks.get(first, {}), absent, self.model.index.num_experts,
                                       self.model.top_k, len(b.states)):
                self.fetcher.request((first, e), priority=-0.5, hold=False)
            return
        for e, n in sorted(self.model.predict_counts(nxt, b.h).items(), key=lambda kv: -kv[1]):
            if not self.cache.resident((nxt, e)):
                self.fetcher.request((nxt, e), priority=-1.0 / (1 + n), hold=False)

    def _take_entering(self) -> tuple[dict, dict]:
        """(the lined-up groups that enter their next layer now, by (wave, layer); the ones
        that keep waiting, by layer): see entering_now."""
        if not self._entering:
            return {}, {}
        groups: dict[tuple[int, int], list[tuple[Batch, list[int]]]] = {}
        for layer, parts in self._entering.items():
            for b, idx in parts:
                groups.setdefault((self._wave(b), layer), []).append((b, idx))
        size = {key: sum(1 for b, idx in parts for i in idx if _alive(b.states[i])) for key, parts in groups.items()}
        behind = [(self._wave(b), b.layer - 1) for b in self._batches for i, st in enumerate(b.states)
                  if not b.moved[i] and _alive(st)]
        behind += [(self._seq_wave(s), -1) for s in self.seqs.values() if s.layer < 0 and s.feed]
        now = entering_now(size, behind, self.fetcher.idle())
        wait: dict[int, list[tuple[Batch, list[int]]]] = {}
        for (_w, layer), parts in groups.items():
            if (_w, layer) not in now:
                wait.setdefault(layer, []).extend(parts)
        return {k: p for k, p in groups.items() if k in now}, wait

    def _arrivals(self, wait_s: float) -> None:
        """Experts that landed for waiters: pinned once until their waiters were served."""
        with self._phase("waiting" if wait_s else "scheduling"):
            arrived = self.fetcher.take_arrived(wait_s=wait_s)
        for key in arrived:
            self._held.add(key)
            self._asked.pop(key, None)


# Of one wave's head + attention time, the part a second wave adds when the requests split
# (tuned by hand on the AVX2 set of docs/moe.md; at 16 rows the widening kernels' time grows
# with the rows, so half the rows twice costs far less than twice).
SPLIT_COST = 0.3
# In two waves, the compute thread's busy share of the wall time above which the split's extra
# compute is what the requests wait for: back to one wave.
COMPUTE_BOUND = 0.95


def two_waves(wall_s: float, compute_s: float, disk_s: float, split_s: float, waves: int) -> bool:
    """Whether Bevy's next passes move in two waves, from the last window's seconds: its
    wall time, the scheduler's compute time, the disk's busy time, and one wave's head and
    attention time (what a second wave pays again, in part: SPLIT_COST).

    One wave pays each layer's attention and the head once a step, but while it computes
    the experts that landed last for a layer, attends the next one and runs the head, no
    request of it has a miss to read: the disk idles; and while it waits for a read, the
    compute idles. The wall time beyond the busier of the two (compute, disk) is that
    stall. Two waves that move independently fill it with each other's work. From one
    wave: split when the stall is worth more than the split's extra compute. In two:
    stay until the compute is busy nearly all the time (COMPUTE_BOUND), where that extra
    compute is what the requests wait for. (A disk busy all the time has no stall: one
    wave.)"""
    if waves < 2:
        return wall_s - max(compute_s, disk_s) > SPLIT_COST * split_s
    return compute_s < COMPUTE_BOUND * wall_s


def picked_share(experts: int, top_k: int, requests: int) -> float:
    """The chance that `requests` tokens, each picking top_k of `experts` uniformly, pick a
    given expert: also the expected share of the experts they pick between them."""
    return 1.0 - (1.0 - top_k / experts) ** requests


def next_pass_guesses(picks: dict[int, int], absent: list[int], experts: int, top_k: int,
                      rows: int) -> list[int]:
    """What bevy_guess reads while a pass runs the head: the first MoE layer's experts the
    next pass of its `rows` requests will likely pick, of the `absent` ones (not resident).

    No hidden state tells them (the next tokens are not sampled yet). A request picks top_k
    of `experts`, so an absent expert is needed by one of `rows` requests with probability
    1 - (1 - top_k/experts)**rows if routing were uniform: below one half a read is more
    likely wasted than used, and none is guessed. Else as many as the requests would miss
    on average, the ones picked most so far (`picks`) first."""
    used = picked_share(experts, top_k, rows)
    if used < 0.5:
        return []
    return sorted(absent, key=lambda e: (-picks.get(e, 0), e))[:round(used * len(absent))]


def wave_count(requests: int, experts: int, top_k: int, cache_slots: int) -> int:
    """How many waves the cache allows `requests` in: 2 when it holds what both need.

    Two waves drift up to about a layer apart, so the cache must hold two layers' worth
    of the experts a whole wave picks (expected distinct experts of `requests` tokens
    choosing top_k of `experts` uniformly; trained routers pick fewer): otherwise the
    second wave reads again what the first just used (a few wide experts, as Mixtral's 8,
    need every expert of a layer: one wave)."""
    if requests < 2:
        return 1
    distinct = experts * picked_share(experts, top_k, requests)
    return 2 if 2 * distinct <= cache_slots else 1


def entering_now(lined_up: dict[tuple[int, int], int], behind: list[tuple[int, int]],
                 disk_idle: bool) -> set[tuple[int, int]]:
    """Which lined-up groups of Bevy enter their next layer now.

    lined_up: (wave, layer done) -> requests lined up to enter layer + 1; behind: for every
    other request, (its wave, the last layer it is done with: -1 it has not started, L - 1
    it waits for experts at L). A group enters once no request of its wave is behind it:
    those would enter the same layer later, and every entry reads the layer's attention
    weights (past the last layer, the head's: a 150k-token vocabulary is as many bytes as
    several layers) whatever the rows, so a wave split in two pays them twice. Waiting
    costs nothing while the disk is busy: the ones behind wait for it. When the disk has
    nothing to read, the biggest group (of any wave; then the furthest) enters at once, so
    that its next layer's misses keep the disk busy."""
    at = behind + [k for k, n in lined_up.items() if n]  # where every request is
    now = {(w, m) for w, m in lined_up if not any(pw == w and p < m for pw, p in at)}
    if not now and disk_idle and lined_up:
        now = {max(lined_up, key=lambda k: (lined_up[k], k[1]))}
    return now


def make_scheduler(kind: str, model: MoEModel, cache: ExpertCache, fetcher: Fetcher) -> Scheduler:
    if kind == "bevy":
        return BevyScheduler(model, cache, fetcher)
    if kind == "bevy_guess":  # not a listed scheduler: the ablation of docs/moe.md
        return BevyScheduler(model, cache, fetcher, guess=True)
    if kind in ("bevy_one_wave", "bevy_two_waves"):  # not listed: Bevy's waves fixed (docs/moe.md)
        return BevyScheduler(model, cache, fetcher, waves=1 if kind == "bevy_one_wave" else 2)
    if kind in ("on_demand", "prefetch", "resident"):
        return LockstepScheduler(model, cache, fetcher, kind)
    if kind == "on_demand_overlap":  # not a listed baseline: the overlap ablation of docs/moe.md
        return LockstepScheduler(model, cache, fetcher, "on_demand", overlap=True)
    raise ValueError(f"unknown scheduler {kind!r}; choose one of {', '.join(SCHEDULERS)}")

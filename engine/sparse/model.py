"""The sparse model: transformers' decoder with every FFN replaced by a
SparseMLP that computes only the active neurons, from bundles the runtime
brings in (neuron cache, delta prefetch, on-demand reads).

Two modes:
  predicted  bundles = gate + up + down. The own-layer low-rank predictor
             decides which neurons to compute; each computed neuron is exact
             and is also thresholded on its true activation (CATS), so the
             output is the threshold model restricted to the predicted set.
  exact      the gate matrix stays resident (a third of the FFN bytes); the
             active set is computed exactly (|act(gate x)| > tau), bundles =
             up + down. With tau = 0 the output equals the dense model.
Either way, as soon as layer l's set is known, its misses (needed - resident
- already in flight) go out as one batched read; then (decode) the ahead
predictor's most confident guesses for layer l+1 are prefetched behind them;
the resident rows are computed while the reads are in flight.

16-bit stores (f16/bf16 checkpoints) compute in the weights' own dtype with
f32 accumulation (weights.mixed_linear), as llama.cpp does; activations,
thresholds and the residual stream stay f32.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sparse.cache import NeuronCache
from engine.sparse.calibrate import Calibration, activation
from engine.sparse.memory import BudgetGovernor, MemoryPolicy
from engine.sparse.predictor import LowRankPredictor
from engine.sparse.prefetch import SOURCES, Prefetcher, Slots
from engine.sparse.store import BundleStore
from engine.sparse.weights import FFNLayout, mixed_linear

MODES = ("predicted", "exact")
# The most bundle bytes one FFN step gathers (or a spill read stages) at once: a prefill chunk
# needs nearly every neuron of a layer, and gathering a whole layer of 8B-shaped bundles would
# take 350 MB on top of the cache. A layer's neurons go through in slices of this size instead.
SLICE_BYTES = 64 << 20


def slice_neurons(row_bytes: int) -> int:
    """How many neurons one slice holds (at least one)."""
    return max(1, SLICE_BYTES // max(1, int(row_bytes)))


@dataclass
class SparseRuntimeConfig:
    mode: str = "predicted"  # "predicted" (stream gate+up+down) or "exact" (gate resident)
    prefetch: str = "lowrank"  # what is read ahead: lowrank (ahead predictor), temporal (last token's set), both, none
    prefetch_top: float = 0.25  # lowrank: read ahead only the most confident guesses, at most this share of the
    #                             layer's mean active count (the predictor's precision is highest at the top;
    #                             a wrong guess costs a whole request of the disk's IOPS). 1.0 = every guess
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)  # free-RAM adaptation


@dataclass
class TokenStats:
    jaccard_sum: np.ndarray | None = None  # per layer: sum of Jaccard(prev token set, this set)
    jaccard_n: int = 0  # decode tokens contributing


class SparseRuntime:
    """Shared state of all SparseMLPs: store, cache, prefetcher, predictors."""

    def __init__(self, layout: FFNLayout, store: BundleStore, calib: Calibration, budget: int,
                 min_budget: int, cfg: SparseRuntimeConfig, gates: list[torch.Tensor] | None) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"unknown sparse mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
        if cfg.prefetch not in SOURCES:
            raise ValueError(f"unknown prefetch source {cfg.prefetch!r}; choose one of {', '.join(SOURCES)}")
        self.layout, self.store, self.calib, self.cfg = layout, store, calib, cfg
        self.gates = gates  # exact mode: resident gate matrices [N, h] per layer
        self.act = activation(layout.act)
        self.cache = NeuronCache(layout.num_layers, layout.neurons, store.row_shape, budget, min_budget,
                                 store.np_dtype, store.cache_slot_bytes)
        self.torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[store.dtype]
        self.slice = slice_neurons(self.cache.row_bytes)  # neurons computed (and spilled) at once
        self.prefetcher = Prefetcher(store, self.cache, self.slice)
        # compute in place on the cache (no gather of down rows, a gather of up rows only) when the
        # slots are unpadded bundles: the slab is then a [slots * P, h] matrix of rows
        self.slab = None
        if self.prefetcher.direct and self.cache.row_bytes == self.cache.payload:
            self.slab_np = self.cache._all.reshape(-1, layout.hidden)  # [R * P, h], a view
            self.slab = self.to_torch(self.slab_np)
            self.prefetcher.in_place = True
        self.part = {p: i for i, p in enumerate(store.parts)}
        self.governor = BudgetGovernor(budget, min_budget, cfg.memory)
        self.lock = threading.Lock()  # held per layer by the compute thread; budget changes wait on it
        self.prev: list[np.ndarray | None] = [None] * layout.num_layers  # last decode token's set per layer
        self.stats = TokenStats(jaccard_sum=np.zeros(layout.num_layers))
        # benchmark scenarios only: (layer, true active ids) -> the ids to use instead (a replayed
        # trace with a chosen overlap). Never set in serving: outputs are then not the model's.
        self.trace = None

    # -- budget -----------------------------------------------------------------------
    def set_budget(self, nbytes: int) -> None:
        """The user's budget: validated now, applied between two layers."""
        self.cache.check_budget(nbytes)
        with self.lock:
            self.governor.user_budget = int(nbytes)
            self._resize(int(nbytes))

    def _resize(self, nbytes: int) -> None:
        self.prefetcher.drain()  # reads in flight would land in a cache of another size
        self.cache.resize(nbytes)

    def _maybe_adapt(self) -> None:
        want = self.governor.propose(self.cache.budget_bytes)
        if want is not None and want // self.cache.row_bytes != self.cache.capacity:
            self._resize(want)

    # -- per layer ----------------------------------------------------------------------
    def which(self, layer: int, x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor | None]:
        """(needed ids [k], per-token mask [T, N], exact activations [T, N] or None)."""
        tau = self.calib.thresholds[layer]
        if self.cfg.mode == "exact":
            a = self.act(mixed_linear(x, self.gates[layer]))  # [T, N] f32
            mask = a.abs() > tau
            need = np.nonzero(mask.any(0).numpy())[0]
            if self.trace is not None and x.shape[0] == 1:  # benchmark scenario: a replayed active set
                need = self.trace(layer, need)
                mask = torch.zeros_like(mask)
                mask[:, torch.from_numpy(need)] = True
            return need, mask, a
        own = self.calib.own[layer]
        if own is None:  # sparsity 0: every neuron
            mask = torch.ones(x.shape[0], self.layout.neurons, dtype=torch.bool)
            return np.arange(self.layout.neurons), mask, None
        mask = own.predict(x)
        return np.nonzero(mask.any(0).numpy())[0], mask, None

    def prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        """At layer-1's FFN (decode): start reading layer's predicted delta."""
        src = self.cfg.prefetch
        if src == "none" or layer >= self.layout.num_layers:
            return
        ids: np.ndarray | None = None
        ahead: LowRankPredictor | None = self.calib.ahead[layer]
        if src in ("lowrank", "both"):
            if ahead is not None:
                with torch.no_grad():
                    logits = ahead(x)[0]  # [N]
                ids = np.nonzero((logits > ahead.cutoff).numpy())[0]
                k = int(self.cfg.prefetch_top * self.calib.mean_active[layer])
                if len(ids) > k:  # the most confident guesses only
                    top = torch.topk(logits, max(k, 0)).indices.numpy()
                    ids = np.sort(top[(logits[top] > ahead.cutoff).numpy()])
            elif self.calib.own[layer] is None and self.cfg.mode == "predicted":
                ids = np.arange(self.layout.neurons)  # every neuron will be needed
        if src in ("temporal", "both") and self.prev[layer] is not None:
            ids = self.prev[layer] if ids is None else np.union1d(ids, self.prev[layer])
        if ids is not None:
            self.prefetcher.issue(layer, ids)

    def record(self, layer: int, need: np.ndarray) -> None:
        prev = self.prev[layer]
        if prev is not None:
            inter = len(np.intersect1d(prev, need, assume_unique=True))
            union = len(prev) + len(need) - inter
            self.stats.jaccard_sum[layer] += inter / max(union, 1)
            if layer == 0:
                self.stats.jaccard_n += 1
        self.prev[layer] = need

    def forget_sequence(self) -> None:
        """A new request: the previous token's sets belong to another text."""
        self.prev = [None] * self.layout.num_layers

    def to_torch(self, rows: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(rows)
        return t.view(torch.bfloat16) if self.torch_dtype == torch.bfloat16 else t

    def close(self) -> None:
        self.prefetcher.drain()
        self.store.close()
        self.cache.close()


class SparseMLP(torch.nn.Module):
    """Drop-in for a gated MLP: y = sum over active i of act(g_i) * u_i * down_i."""

    def __init__(self, rt: SparseRuntime, layer: int) -> None:
        super().__init__()
        self.rt, self.layer = rt, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rt, l = self.rt, self.layer
        shape = x.shape
        xt = x.reshape(-1, shape[-1])  # [T, h]
        with rt.lock:
            if l == 0:
                rt._maybe_adapt()
            rt.cache.tick += 1
            need, mask, a = rt.which(l, xt)
            decode = xt.shape[0] == 1
            chunks = rt.prefetcher.plan(l, need)  # this layer's misses are on their way now
            if decode:
                rt.prefetch_next(l + 1, xt)  # behind them in the device queue
            y = None
            sel_all = torch.from_numpy(need)
            # resident rows first, while the reads are in flight; each chunk is at most rt.slice
            # rows (the prefetcher slices them), so what one step gathers stays within SLICE_BYTES
            for pos, rows in chunks:
                sel = sel_all[torch.from_numpy(pos)]
                if isinstance(rows, Slots):
                    part = self._partial_in_place(xt, np.asarray(rows), sel, mask, a)
                else:
                    part = self._partial(xt, rt.to_torch(rows), sel, mask, a)
                y = part if y is None else y + part
            if y is None:
                y = torch.zeros_like(xt)
            if decode:
                rt.record(l, need)
        return y.reshape(shape)

    def _partial_in_place(self, xt, slots, sel, mask, a):
        """The FFN output of neurons `sel` whose bundles sit in cache `slots`: up (and gate)
        rows gathered, down rows summed in place (embedding_bag: y = sum_i v_i down_i)."""
        rt, l = self.rt, self.layer
        W, P, rows = rt.slab, len(rt.part), rt.slab_np  # the same [R * P, h] rows: torch and numpy views
        base_np = slots * P
        base = torch.from_numpy(base_np)
        keep = mask[:, sel]  # [T, k]

        def gather(part):  # np.take of whole rows: a memcpy each (torch's index_select is ~30x slower
            return rt.to_torch(np.take(rows, base_np + rt.part[part], axis=0))  # on 16-bit rows here)

        up = gather("up")  # [k, h]
        if rt.cfg.mode == "exact":
            act = a[:, sel] * keep
        else:
            act = rt.act(mixed_linear(xt, gather("gate")))
            tau = rt.calib.thresholds[l]
            act = act * (keep & (act.abs() > tau)) if tau > 0 or not keep.all() else act
        v = act * mixed_linear(xt, up)  # [T, k] f32
        down = base + rt.part["down"]
        if xt.shape[0] == 1:
            y = torch.nn.functional.embedding_bag(down[None], W, per_sample_weights=v.to(W.dtype), mode="sum")
            return y.float()
        d = gather("down")  # prefill: [k, h]
        return v @ d if d.dtype == torch.float32 else (v.to(d.dtype) @ d).float()

    def _partial(self, xt, rows, sel, mask, a):
        """The FFN output of neurons `sel` from their bundles rows [k, P, h]."""
        rt, l = self.rt, self.layer
        keep = mask[:, sel]  # [T, k]
        if rt.cfg.mode == "exact":
            up, down = rows[:, 0], rows[:, 1]  # [k, h] each
            act = a[:, sel] * keep
        else:
            gate, up, down = rows[:, 0], rows[:, 1], rows[:, 2]
            act = rt.act(mixed_linear(xt, gate))  # [T, k]
            tau = rt.calib.thresholds[l]
            act = act * (keep & (act.abs() > tau)) if tau > 0 or not keep.all() else act
        v = act * mixed_linear(xt, up)  # [T, k] f32
        if down.dtype == torch.float32:
            return v @ down  # [T, h]
        return (v.to(down.dtype) @ down).float()

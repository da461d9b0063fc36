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
Either way, at layer l (decode) the ahead predictor guesses layer l+1's set
from x_l and the prefetcher starts reading its delta at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.sparse.cache import NeuronCache
from engine.sparse.calibrate import Calibration, activation
from engine.sparse.memory import BudgetGovernor, MemoryPolicy
from engine.sparse.predictor import LowRankPredictor
from engine.sparse.prefetch import SOURCES, Prefetcher
from engine.sparse.store import BundleStore
from engine.sparse.weights import FFNLayout

MODES = ("predicted", "exact")


@dataclass
class SparseRuntimeConfig:
    mode: str = "predicted"  # "predicted" (stream gate+up+down) or "exact" (gate resident)
    prefetch: str = "lowrank"  # what is read ahead: lowrank (ahead predictor), temporal (last token's set), both, none
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
        self.cache = NeuronCache(layout.num_layers, layout.neurons, store.row_shape, budget, min_budget)
        self.prefetcher = Prefetcher(store, self.cache)
        self.governor = BudgetGovernor(budget, min_budget, cfg.memory)
        self.lock = threading.Lock()  # held per layer by the compute thread; budget changes wait on it
        self.prev: list[np.ndarray | None] = [None] * layout.num_layers  # last decode token's set per layer
        self.stats = TokenStats(jaccard_sum=np.zeros(layout.num_layers))

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
            a = self.act(x @ self.gates[layer].T)  # [T, N]
            mask = a.abs() > tau
            return np.nonzero(mask.any(0).numpy())[0], mask, a
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
                ids = np.nonzero(ahead.predict(x)[0].numpy())[0]
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
            if decode:
                rt.prefetch_next(l + 1, xt)
            rows = torch.from_numpy(rt.prefetcher.rows(l, need))  # [k, P, h]
            sel = torch.from_numpy(need)
            keep = mask[:, sel]  # [T, k]
            if rt.cfg.mode == "exact":
                up, down = rows[:, 0], rows[:, 1]  # [k, h] each
                act = a[:, sel] * keep
            else:
                gate, up, down = rows[:, 0], rows[:, 1], rows[:, 2]
                act = rt.act(xt @ gate.T)  # [T, k]
                tau = rt.calib.thresholds[l]
                act = act * (keep & (act.abs() > tau)) if tau > 0 or not keep.all() else act
            y = (act * (xt @ up.T)) @ down  # [T, k] -> [T, h]
            if decode:
                rt.record(l, need)
        return y.reshape(shape)

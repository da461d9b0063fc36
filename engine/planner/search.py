"""The planner's search: the exact min-bottleneck DP over layer boundaries (plan.auto_plan).

It sees the fleet only through plan_cost._Fleet's cost methods (bw, kv_layer, fixed, os,
hop_ms, resident embedding/head/tail bytes, the cumulative layer bytes Wf).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

MAX_EXHAUSTIVE_PEERS = 6  # try every peer order up to this many peers
REL_TIE = 1e-6  # bottlenecks within this relative distance are a tie
StageSpec = tuple[str, str, int, int]  # (peer_id, device, start, end)

class Search:
    """Exact min-bottleneck DP over layer boundaries for every peer order."""

    def __init__(self, fleet: Any, devices: Mapping[str, str]) -> None:
        self.f, self.dev = fleet, devices
        ids = sorted(devices)
        self.bw = {p: fleet.bw(p, devices[p]) for p in ids}
        self.exhaustive = len(ids) <= MAX_EXHAUSTIVE_PEERS
        self.ids = ids if self.exhaustive else sorted(
            ids, key=lambda p: (-self.bw[p], -fleet.peers[p].ram_free_bytes, p))
        L = fleet.L
        idx = np.arange(L + 1)
        self.D = fleet.Wf[None, :] - fleet.Wf[:, None]  # D[s, e] = bytes of [s, e)
        self.XD = fleet.Xf[None, :] - fleet.Xf[:, None]  # XD[s, e] = routed-expert bytes of [s, e)
        self.nl = idx[None, :] - idx[:, None]  # nl[s, e] = e - s
        self._cache: dict = {}

    def _mats(self, p: str, first: bool):
        """Compute-ms matrix, fit mask (non-last), last-stage compute and fit vectors."""
        key = (p, first)
        if key not in self._cache:
            f, bw, ram = self.f, self.bw[p], self.f.peers[p].ram_free_bytes
            frac = f.request.runtime_reserve_fraction
            kvl, base = f.kv_layer(p, self.dev[p]), f.fixed(p, self.dev[p]) + f.os(p)
            emb = (f.emb - f.mapped(p, self.dev[p], True)) if first else 0  # what stage 0 holds of it

            xe = np.ceil(f.expert_extra(p, self.dev[p]) * self.XD)  # MoE experts' extra copies

            def fits(w, nl, x):  # the same sum as _Fleet.memory, for every range at once
                tot = w + kvl * nl + base + np.ceil(frac * w) + x
                return (nl > 0) & (tot <= ram)

            comp = self.D / bw
            ok = fits(self.D + emb + f.tail, self.nl, xe)
            w_last = self.D[:, -1] + emb + f.head
            comp_last = (self.D[:, -1] + f.head) / bw
            ok_last = fits(w_last, self.nl[:, -1], xe[:, -1])
            self._cache[key] = (comp, ok, comp_last, ok_last)
        return self._cache[key]

    def _children(self, prefix: list[str]) -> list[str]:
        if len(prefix) >= self.f.L:
            return []
        if self.exhaustive:
            return [p for p in self.ids if p not in prefix]
        return self.ids[len(prefix):len(prefix) + 1]

    def _start(self) -> np.ndarray:
        r = np.full(self.f.L + 1, np.inf)
        r[0] = 0.0
        return r

    def bottlenecks(self) -> dict[int, float]:
        """Best bottleneck per number of peers used (phase 1, branch and bound)."""
        best: dict[int, float] = {}
        bound = [np.inf]

        def visit(prefix: list[str], R: np.ndarray) -> None:
            p, first = prefix[-1], len(prefix) == 1
            comp, ok, comp_last, ok_last = self._mats(p, first)
            t_last = comp_last + self.f.hop_ms(p, prefix[0], True)
            cand = float(np.where(ok_last, np.maximum(R, t_last), np.inf).min())
            m = len(prefix)
            if cand < best.get(m, np.inf):
                best[m] = cand
                bound[0] = min(bound[0], cand)
            for q in self._children(prefix):
                C = comp + self.f.hop_ms(p, q, False)
                R2 = np.where(ok, np.maximum(R[:, None], C), np.inf).min(axis=0)
                lo = R2.min()
                if np.isfinite(lo) and lo <= bound[0] * (1 + REL_TIE):
                    visit(prefix + [q], R2)

        for p in self._children([]):
            visit([p], self._start())
        return best

    def cheapest(self, m: int, limit: float) -> list[StageSpec]:
        """Plan with m peers, every stage <= limit, minimal cycle (phase 2)."""
        best: list = [np.inf, None]

        def visit(prefix: list[str], S: np.ndarray, back: list[np.ndarray]) -> None:
            p, first = prefix[-1], len(prefix) == 1
            comp, ok, comp_last, ok_last = self._mats(p, first)
            if len(prefix) == m:
                t_last = comp_last + self.f.hop_ms(p, prefix[0], True)
                tot = np.where(ok_last & (t_last <= limit), S + t_last, np.inf)
                s = int(np.argmin(tot))
                if tot[s] < best[0] * (1 - 1e-12):
                    starts = [s]
                    for arr in reversed(back):
                        starts.append(int(arr[starts[-1]]))
                    starts.reverse()
                    ends = starts[1:] + [self.f.L]
                    best[:] = [float(tot[s]),
                               [(q, self.dev[q], a, b) for q, a, b in zip(prefix, starts, ends)]]
                return
            for q in self._children(prefix):
                C = comp + self.f.hop_ms(p, q, False)
                M = np.where(ok & (C <= limit), S[:, None] + C, np.inf)
                S2 = M.min(axis=0)
                if S2.min() < best[0]:
                    visit(prefix + [q], S2, back + [M.argmin(axis=0)])

        for p in self._children([]):
            visit([p], self._start(), [])
        return best[1]

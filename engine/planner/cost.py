"""The planner's cost model: a stage's memory parts and predicted time at one precision (_Fleet).

The model behind each number is described in plan.py's docstring and docs/planner.md.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from engine.planner.issues import PlanError
from engine.planner.memory import (
    AUTO, KV_DEFAULT_PRECISION, KV_U8_GROWTH, embedding_mapped, expert_copies, kv_element_bytes, prefill_scratch)
from engine.planner.model import PlanModel
from engine.planner.peers import Links, PeerProfile, link_between
from engine.planner.request import PlanRequest
from engine.planner.search import StageSpec
from engine.planner.stages import Plan, Stage

RETURN_BYTES = 8  # the last stage sends a token id (+ header) back, not logits


class StageMemory(NamedTuple):
    """A stage's memory parts, bytes."""

    weights: int  # its shard at the plan's precision
    mapped: int  # the part of weights read in place from the mapped file (not in total)
    kv: int  # KV cache for context x streams over its layers
    runtime: int  # the worker's own memory (runtime_reserve)
    os: int  # left to the peer's OS and owner

    @property
    def total(self) -> int:
        return self.weights - self.mapped + self.kv + self.runtime + self.os


class _Fleet:
    """The numbers behind every cost at one concrete precision: bytes, bandwidths, links."""

    def __init__(self, model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
                 links: Links | None = None) -> None:
        self.model, self.request, self.links = model, request, links or {}
        self.peers: dict[str, PeerProfile] = {}
        for p in peers:
            if p.peer_id in self.peers:
                raise PlanError(f"peer id {p.peer_id} appears twice in the fleet")
            self.peers[p.peer_id] = p
        prec = request.weight_precision
        self.precision = model.checkpoint_precision if prec == AUTO else prec
        self.W = [0]  # W[i] = weight bytes of layers [0, i) at the precision
        for b in model.layer_weight_bytes(self.precision):
            self.W.append(self.W[-1] + b)
        self.Wf = np.array(self.W, dtype=np.float64)
        self.X = [0]  # X[i] = routed-expert bytes of layers [0, i) at the precision
        for b in model.expert_weight_bytes(self.precision):
            self.X.append(self.X[-1] + b)
        self.Xf = np.array(self.X, dtype=np.float64)
        self.emb = model.embedding_weight_bytes(self.precision)
        self.head = model.head_weight_bytes(self.precision)
        self.tail = model.tail_extra_bytes(self.precision)  # a stage without the head pays it
        self.context = request.context_for(model)
        self.tokens = self.context * request.streams  # KV tokens per layer
        self.L = model.num_layers
        self.mean_layer = self.W[-1] / self.L

    def kv_element(self, peer_id: str, device: str) -> float:
        r = self.request
        if r.kv_dtype_bytes is not None:
            return r.kv_dtype_bytes
        return kv_element_bytes(self.peers[peer_id].device(device).kind, r.exact, head_dim=self.model.head_dim)

    def _u8(self, peer_id: str, device: str) -> bool:
        r = self.request
        kind = self.peers[peer_id].device(device).kind
        return r.kv_dtype_bytes is None and not r.exact and KV_DEFAULT_PRECISION.get(kind) == "u8"

    def kv_layer(self, peer_id: str, device: str) -> int:
        """KV bytes of one layer on this peer's device, at its peak."""
        grow = KV_U8_GROWTH if self._u8(peer_id, device) else 1.0
        return math.ceil(self.model.kv_elements_per_token_per_layer * self.tokens
                         * self.kv_element(peer_id, device) * grow)

    def fixed(self, peer_id: str, device: str) -> int:
        """The runtime reserve but its weight fraction: measured fixed part + prefill activations."""
        r, m = self.request, self.model
        if not r.prefill_chunk:
            return r.runtime_reserve_bytes
        deq = m.kv_elements_per_token_per_layer if self._u8(peer_id, device) else 0
        inter = m.intermediate_size or 4 * m.hidden_size
        return r.runtime_reserve_bytes + prefill_scratch(m.query_heads, inter, self.context, r.prefill_chunk, deq)

    def os(self, peer_id: str) -> int:
        r = self.request.os_reserve_bytes
        return self.peers[peer_id].os_reserve_bytes() if r is None else r

    def expert_extra(self, peer_id: str, device: str) -> float:
        """Extra copies of the routed experts the device's runtime holds beyond the shard's one."""
        return expert_copies(self.peers[peer_id].device(device).kind) - 1.0

    def mapped(self, peer_id: str, device: str, first: bool) -> int:
        """Embedding bytes a first stage on this device reads from the mapped file."""
        return self.emb if first and embedding_mapped(self.peers[peer_id].device(device).kind) else 0

    def weights(self, s: int, e: int, first: bool, last: bool) -> int:
        return self.W[e] - self.W[s] + (self.emb if first else 0) + (self.head if last else self.tail)

    def memory(self, peer_id: str, device: str, s: int, e: int, first: bool, last: bool) -> StageMemory:
        """Memory of a stage over [s, e) on this peer's device."""
        w = self.weights(s, e, first, last)
        mapped = self.mapped(peer_id, device, first)
        rt = (self.fixed(peer_id, device) + math.ceil(self.request.runtime_reserve_fraction * (w - mapped))
              + math.ceil(self.expert_extra(peer_id, device) * (self.X[e] - self.X[s])))
        return StageMemory(w, mapped, self.kv_layer(peer_id, device) * (e - s), rt, self.os(peer_id))

    def bw(self, peer_id: str, device: str) -> float:
        return self.peers[peer_id].device(device).bytes_per_ms(self.mean_layer)

    def compute_ms(self, bw: float, s: int, e: int, last: bool) -> float:
        return (self.W[e] - self.W[s] + (self.head if last else 0)) / bw

    def hop_ms(self, a: str, b: str, last: bool) -> float:
        nbytes = RETURN_BYTES if last else self.model.activation_bytes_per_token
        return link_between(self.links, a, b).transfer_ms(nbytes)

    def best_device(self, peer_id: str, preference: Sequence[str],
                    pinned: Mapping[str, str]) -> str | None:
        p = self.peers[peer_id]
        if peer_id in pinned:
            if p.device(pinned[peer_id]) is None:
                raise PlanError(f"peer {p.name or peer_id} has no device {pinned[peer_id]}")
            return pinned[peer_id]
        ok = [d for d in p.devices if d.kind in preference]
        if not ok:
            return None
        best = min(ok, key=lambda d: (-d.bytes_per_ms(self.mean_layer),
                                      list(preference).index(d.kind), d.name))
        return best.name

    def build(self, specs: Sequence[StageSpec]) -> Plan:
        """Predictions for structurally valid specs (memory may overflow)."""
        stages = []
        n = len(specs)
        for i, (pid, dev, s, e) in enumerate(specs):
            first, last = i == 0, i == n - 1
            mem = self.memory(pid, dev, s, e, first, last)
            comp = self.compute_ms(self.bw(pid, dev), s, e, last)
            hop = self.hop_ms(pid, specs[0][0] if last else specs[i + 1][0], last)
            ms = comp + hop
            ram = self.peers[pid].ram_free_bytes
            stages.append(Stage(pid, dev, s, e, mem.weights, mem.kv, mem.runtime, mem.os, mem.total, ram,
                                mem.total <= ram, comp, hop, ms, 1000.0 / ms, mem.mapped))
        cycle = sum(st.predicted_ms_per_token for st in stages)
        bott = max(st.predicted_ms_per_token for st in stages)
        r = self.request
        return Plan(self.model.model_id, tuple(stages), self.precision, self.context,
                    r.streams, bott, cycle, 1000.0 / cycle,
                    min(r.streams * 1000.0 / cycle, 1000.0 / bott), all(st.fits for st in stages),
                    r.exact)

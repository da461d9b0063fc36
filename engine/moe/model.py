"""The resident part of an MoE model, and the batched per-layer steps schedulers drive.

The transformers module tree is built on the meta device (no memory), the
routed experts are cut out, and everything else is loaded from the store's
rest.safetensors. Norms, projections, RoPE tables, routers and Qwen2-MoE's
shared expert are the very transformers modules (their weights and numerics);
only the attention *wiring* is ours, so that one call serves many requests:
the rows of every request in a Batch are concatenated, projected, normed and
routed together, and decode attention is one SDPA over the requests' padded
KV caches (a pool indexed by request slot, see KVPool).

A forward pass is split into steps a scheduler can interleave across requests:

    b = start(states, ids)                 # embed the rows of many requests: a Batch at layer 0
    for each layer L:
        attend(b)                          # attention + router of every row: which experts
        apply_expert(e, views, parts)      # one expert on its rows, across batches (one matmul set)
        b = advance(L + 1, [(b, seqs)])    # residual + routed (+ shared), rows of finished requests
    logits = head(b)                       # [B, vocab] of each request's last position

Weights stay in the store's dtype (the checkpoint's, or int8) and are widened a block at
a time for float32 matmuls (engine/runtime/stored.py); norms, routers and biases are
float32 (a widening of their exact values, < 1 % of the bytes) so routing is computed
as transformers computes it. KV is 16-bit by default. Inference only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from engine.moe.store import REST_FILE, StoreIndex
from engine.runtime import widen_kernel
from engine.runtime.prompt_cache import KeptStates
from engine.runtime.stored import StoredEmbedding, StoredLinear, TensorFile, linear


@dataclass(eq=False)
class SeqState:
    """One request's place in the model (owned by the scheduler thread)."""

    slot: int  # its row in the KV pool
    held: list[int] = field(default_factory=list)  # the ids its KV cache holds, in order (prompt caching)
    ids: list[int] = field(default_factory=list)  # the ids of the current pass

    @property
    def past(self) -> int:
        """Tokens already in its KV cache."""
        return len(self.held)

    @property
    def n(self) -> int:
        """Tokens in the current pass."""
        return len(self.ids)


@dataclass(eq=False)
class Batch:
    """Rows of several requests at one layer (request i owns rows starts[i] .. starts[i] + ns[i])."""

    layer: int  # the layer these rows are at
    states: list[SeqState]  # the requests, in row order
    ns: list[int]  # rows (tokens) per request
    x: torch.Tensor  # [N, H] residual stream
    pos: torch.Tensor  # [N] absolute positions of the rows
    h: torch.Tensor | None = None  # [N, H] normed MoE input of this layer
    wflat: torch.Tensor | None = None  # [N * k] routing weights, row-major
    acc: torch.Tensor | None = None  # [N, H] routed output accumulated so far
    shared: torch.Tensor | None = None  # [N, H] shared-expert output (Qwen2-MoE), else None
    groups: dict[int, tuple] = field(default_factory=dict)  # expert -> (rows [m], flat [m]) of every request
    route: dict[int, dict[int, tuple]] = field(default_factory=dict)  # expert -> request -> (rows, flat) lists
    needs: list[set[int]] = field(default_factory=list)  # per request: experts not applied yet
    moved: list[bool] = field(default_factory=list)  # per request: left this batch (next layer)

    @property
    def starts(self) -> list[int]:
        out, o = [], 0
        for n in self.ns:
            out.append(o)
            o += n
        return out

    @property
    def todo(self) -> set[int]:
        """Experts still to apply at this layer (to requests still here and alive)."""
        out: set[int] = set()
        for i, need in enumerate(self.needs):
            if need and not self.moved[i] and self.states[i].slot >= 0:
                out |= need
        return out


class KVPool:
    """Keys and values of every request, per layer: [slots, kv_heads, capacity, head_dim],
    reserved up front for `slots` concurrent requests of `capacity` positions each (a
    request owns one slot; the engine admits no more than `slots`). 16-bit by default
    (float16: the KV llama.cpp keeps); tests comparing with transformers ask float32.
    The tensors are zero pages until written, so RAM fills as contexts do.

    Prompt caching: a slot given back keeps its KV and the ids it holds (`keep`). A new
    request takes the free slot sharing the longest prefix with its prompt
    (engine/runtime/prompt_cache.py, the local engine's rule) and prefills only the rest;
    otherwise an empty slot, else the one given back longest ago. Kept KV lives in slots
    no request runs in, so caching costs nothing past the reserve."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int = 4, capacity: int = 4096,
                 dtype: torch.dtype = torch.float16, keep: bool = True) -> None:
        self.layers, self.kvh, self.d = layers, kv_heads, head_dim
        self.slots, self.cap, self.dtype = slots, capacity, dtype
        self.k = [torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self._empty = list(range(slots))  # free slots keeping nothing, given back longest ago first
        self._kept: KeptStates[int] = KeptStates()  # free slots whose KV is kept, with the ids it holds
        self.keep = keep
        self._lock = threading.Lock()  # set_keep comes from other threads than the scheduler's

    @staticmethod
    def reserve_bytes(layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int,
                      dtype: torch.dtype = torch.float16) -> int:
        """What a pool of this shape reserves (K and V of every layer)."""
        return 2 * layers * slots * kv_heads * capacity * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.reserve_bytes(self.layers, self.kvh, self.d, self.slots, self.cap, self.dtype)

    def take(self, prompt_ids: Sequence[int] = ()) -> tuple[int, int]:
        """(a free slot for a request with this prompt, how many of its first ids the slot's KV holds)."""
        with self._lock:
            found = self._kept.take(prompt_ids)
            if found is not None:
                return found[0], found[2]
            if self._empty:
                return self._empty.pop(0), 0
            if self._kept:
                return self._kept.pop()[0], 0
            raise RuntimeError(f"every one of the {self.slots} KV slots is taken")

    def give(self, slot: int, held: Sequence[int] = ()) -> None:
        """The slot is free again; its KV holds `held` (kept for a later prompt while `keep`)."""
        with self._lock:
            if self.keep and held:
                self._kept.keep(slot, held)
            else:
                self._empty.append(slot)

    def set_keep(self, keep: bool) -> None:
        with self._lock:
            self.keep = keep
            if not keep:
                self._empty += self._kept.drop(len(self._kept))

    @property
    def kept_tokens(self) -> int:
        """Positions the free slots keep for later prompts."""
        with self._lock:
            return self._kept.tokens

    def ensure(self, length: int) -> None:
        if length > self.cap:
            raise ValueError(f"{length} positions exceed the KV reserve of {self.cap} per request")


class MoEModel:
    def __init__(self, store_dir: Path, index: StoreIndex, kv_slots: int = 4, kv_capacity: int = 4096,
                 kv_dtype: torch.dtype = torch.float16, native_rows: int = 0) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.index = index
        # 16-bit weights multiply in their own dtype for up to this many rows (engine/runtime/stored.py)
        self.native_rows = native_rows
        config = AutoConfig.from_pretrained(store_dir)
        config._attn_implementation = "sdpa"
        self.config = config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.layers = model.model.layers
        self.moe_layers = frozenset(index.moe_layers)
        for i in self.moe_layers:  # the routed experts live in the store, not here
            self.layers[i].mlp.experts = torch.nn.Identity()
        _load_resident(model, Path(store_dir) / REST_FILE, config)
        self.model = model.eval()
        self.hidden = int(config.hidden_size)
        self.act = _act(config)
        self.silu = getattr(config, "hidden_act", "silu") == "silu"  # the gate widen_kernel.expert computes
        self.top_k = int(index.top_k)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.family = str(config.model_type)
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.windows = [_window(config, i) for i in range(len(self.layers))]
        self.kv = KVPool(len(self.layers), self.kv_heads, self.head_dim, kv_slots, kv_capacity, kv_dtype)
        # q, k and v projections fused into one matmul per layer: [(heads + 2 kvh) d, H], in the
        # weights' dtype; the three modules are dropped so that no weight is held twice.
        self.qkv = []
        for lay in self.layers:
            a = lay.self_attn
            q, k, v = a.q_proj, a.k_proj, a.v_proj
            scale = None if q.scale is None else torch.cat([q.scale, k.scale, v.scale])
            bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
            self.qkv.append(StoredLinear(torch.cat([q.weight, k.weight, v.weight]), scale, bias))
            a.q_proj = a.k_proj = a.v_proj = None
        for m in list(self.model.modules()) + self.qkv:
            if isinstance(m, StoredLinear):
                m.native_rows = native_rows
        self._split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        rope = self.model.model.rotary_emb
        self._rope_static = getattr(rope, "rope_type", "default") == "default"
        self._cos = self._sin = torch.empty(0, self.head_dim)  # RoPE table [positions, d] (static RoPE)

    def resident_bytes(self) -> int:
        """Bytes of every resident weight (what the model holds besides experts and KV)."""
        seen, n = set(), 0
        tensors = [t for m in list(self.model.modules()) + self.qkv if isinstance(m, (StoredLinear, StoredEmbedding))
                   for t in (None if getattr(m, "mapped", False) else m.weight, m.scale, getattr(m, "bias", None))
                   if t is not None]
        tensors += list(self.model.parameters()) + list(self.model.buffers())
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n += t.numel() * t.element_size()
        return n

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_state(self, prompt_ids: Sequence[int] = ()) -> SeqState:
        """A KV slot for a new request; its `past` ids of prompt_ids are in the slot already
        (prompt caching: they need no prefill)."""
        slot, reuse = self.kv.take(prompt_ids)
        return SeqState(slot=slot, held=list(prompt_ids[:reuse]))

    def free_state(self, s: SeqState) -> None:
        """The request is gone: its KV slot may be reused (by requests admitted later), and
        what it holds by a later prompt that starts the same way."""
        if s.slot >= 0:
            self.kv.give(s.slot, s.held)
            s.slot = -1

    # -- steps --------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, states: list[SeqState], ids: list[list[int]]) -> Batch:
        """A new pass of each request (its next tokens `ids`): embedded rows at layer 0."""
        flat = [t for seq in ids for t in seq]
        pos = []
        for s, seq in zip(states, ids):
            s.ids = list(seq)
            pos.extend(range(s.past, s.past + s.n))
        self.kv.ensure(max(s.past + s.n for s in states))
        x = self.model.model.embed_tokens(torch.tensor(flat, dtype=torch.long))  # [N, H]
        return Batch(0, list(states), [s.n for s in states], x, torch.tensor(pos, dtype=torch.long))

    @torch.inference_mode()
    def attend(self, b: Batch) -> bool:
        """Attention of layer b.layer over all rows, then its router. True if routed
        experts are needed (b.groups set); False for a dense layer (its MLP is done)."""
        lay = self.layers[b.layer]
        b.x = b.x + self._attention(b, lay.self_attn, _rms(lay.input_layernorm, b.x))
        h = _rms(lay.post_attention_layernorm, b.x)  # [N, H]
        if b.layer not in self.moe_layers:
            b.x = b.x + lay.mlp(h)
            return False
        mlp = lay.mlp
        _, weights, experts = mlp.gate(h)  # [N, k] each
        b.h, b.wflat = h, weights.reshape(-1)
        b.acc = torch.zeros_like(h)
        b.shared = None
        if hasattr(mlp, "shared_expert"):
            b.shared = torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)
        # Which rows go to which expert, in plain Python (a few dozen entries per decode step).
        owner = [i for i, n in enumerate(b.ns) for _ in range(n)]
        k = experts.shape[1]
        route: dict[int, dict[int, tuple]] = {}
        for f, e in enumerate(experts.reshape(-1).tolist()):
            row = f // k
            rows, flat = route.setdefault(e, {}).setdefault(owner[row], ([], []))
            rows.append(row)
            flat.append(f)
        b.route = route
        b.groups = {e: (torch.tensor([r for rr, _ in by.values() for r in rr], dtype=torch.long),
                        torch.tensor([f for _, ff in by.values() for f in ff], dtype=torch.long))
                    for e, by in route.items()}
        b.needs = [set() for _ in b.states]
        b.moved = [False] * len(b.states)
        for e, by in route.items():
            for i in by:
                b.needs[i].add(e)
        return True

    def _attention(self, b: Batch, attn, xn: torch.Tensor) -> torch.Tensor:
        """Self-attention of every row of b (xn [N, H] normed input) -> [N, H]."""
        N, d = xn.shape[0], self.head_dim
        q, k, v = self.qkv[b.layer](xn).split(self._split, dim=-1)  # [N, heads * d], [N, kvh * d] x2
        if self.family == "olmoe":  # q/k norm over all heads, then optional clipping
            q, k = attn.q_norm(q), attn.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(N, -1, d), k.view(N, -1, d), v.view(N, -1, d)  # [N, heads|kvh, d]
        if self.family != "olmoe" and hasattr(attn, "q_norm"):  # Qwen3-MoE: per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self._rope(xn, b.pos)  # [N, 1, d] each
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        pk, pv = self.kv.k[b.layer], self.kv.v[b.layer]  # [S, kvh, cap, d]
        window = self.windows[b.layer]
        if all(n == 1 for n in b.ns):  # decode: one padded SDPA over every request
            slots = torch.tensor([s.slot for s in b.states], dtype=torch.long)
            pos = b.pos  # [B] (one row per request)
            pk[slots, :, pos] = k.to(pk.dtype)  # [B, kvh, d] written at each request's position
            pv[slots, :, pos] = v.to(pv.dtype)
            T = int(pos.max()) + 1
            keys = pk[:, :, :T].index_select(0, slots).float()  # [B, kvh, T, d]
            vals = pv[:, :, :T].index_select(0, slots).float()
            mask = None
            if len(b.ns) > 1 and int(pos.min()) + 1 < T or window is not None:
                j = torch.arange(T)[None, :]
                allowed = j <= pos[:, None]  # [B, T]
                if window is not None:
                    allowed &= j > pos[:, None] - window
                mask = allowed[:, None, None, :]  # [B, 1, 1, T]
            out = F.scaled_dot_product_attention(q[:, :, None], keys, vals, attn_mask=mask,
                                                 scale=attn.scaling, enable_gqa=True)  # [B, heads, 1, d]
            return attn.o_proj(out.reshape(N, -1))
        outs = []
        for s, start, n in zip(b.states, b.starts, b.ns):  # prefill (or mixed): request by request
            p0 = s.past
            pk[s.slot, :, p0:p0 + n] = k[start:start + n].transpose(0, 1).to(pk.dtype)
            pv[s.slot, :, p0:p0 + n] = v[start:start + n].transpose(0, 1).to(pv.dtype)
            T = p0 + n
            keys = pk[s.slot:s.slot + 1, :, :T].float()  # [1, kvh, T, d]
            vals = pv[s.slot:s.slot + 1, :, :T].float()
            qi = q[start:start + n].transpose(0, 1)[None]  # [1, heads, n, d]
            mask = None
            if n > 1 or window is not None:
                qp = torch.arange(p0, p0 + n)[:, None]
                j = torch.arange(T)[None, :]
                allowed = j <= qp  # [n, T]
                if window is not None:
                    allowed &= j > qp - window
                mask = allowed[None, None]
            o = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, scale=attn.scaling,
                                               enable_gqa=True)  # [1, heads, n, d]
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
        return attn.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, d] of positions pos [N]: rows of a table the model's own
        rotary module computed (the same values: each entry is one product), or
        that module called on pos when its RoPE depends on the length (dynamic types)."""
        rope = self.model.model.rotary_emb
        if not self._rope_static:
            cos, sin = rope(x[None], pos[None])  # [1, N, d]
            return cos[0, :, None], sin[0, :, None]
        need = int(pos.max()) + 1
        if need > len(self._cos):
            n = max(256, len(self._cos))
            while n < need:
                n *= 2
            cos, sin = rope(x[None, :1], torch.arange(n)[None])  # [1, n, d]
            self._cos, self._sin = cos[0], sin[0]
        return self._cos.index_select(0, pos)[:, None], self._sin.index_select(0, pos)[:, None]

    @torch.inference_mode()
    def predict(self, layer: int, h: torch.Tensor) -> set[int]:
        """The prediction baseline: `layer`'s router applied to another layer's
        hidden state h [N, H] (the experts it guesses `layer` will pick)."""
        return set(self.predict_counts(layer, h))

    @torch.inference_mode()
    def predict_counts(self, layer: int, h: torch.Tensor) -> dict[int, int]:
        """predict(), with how many rows of h each guessed expert was picked for."""
        _, _, experts = self.layers[layer].mlp.gate(h)  # [N, top_k]
        ids, counts = experts.unique(return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))

    @torch.inference_mode()
    def apply_expert(self, expert: int, views: dict, parts: list[tuple[Batch, list[int]]]) -> None:
        """One expert on the rows routed to it of requests parts[j][1] of batch parts[j][0]
        (batches at one layer): one matmul set, the outputs scaled by their routing
        weights and added to each batch."""
        picks = []
        for b, who in parts:
            by = b.route[expert]
            if len(who) == len(by):  # every request of b routed here: the prebuilt index
                picks.append(b.groups[expert])
            else:
                picks.append((torch.tensor([r for i in who for r in by[i][0]], dtype=torch.long),
                              torch.tensor([f for i in who for f in by[i][1]], dtype=torch.long)))
            for i in who:
                b.needs[i].discard(expert)
        if self._fused(views, parts, picks):
            return
        if len(parts) == 1:
            rows = parts[0][0].h.index_select(0, picks[0][0])  # [m, H]
        else:
            rows = torch.cat([b.h.index_select(0, p[0]) for (b, _), p in zip(parts, picks)])
        gate, up = linear(rows, views["gate_up"], views.get("gate_up_scale"),
                          native_rows=self.native_rows).chunk(2, dim=-1)  # [m, I] each
        out = linear(self.act(gate) * up, views["down"], views.get("down_scale"),
                     native_rows=self.native_rows)  # [m, H]
        start = 0
        for (b, _), (r, f) in zip(parts, picks):
            m = len(r)
            b.acc.index_add_(0, r, out[start:start + m] * b.wflat.index_select(0, f)[:, None])
            start += m

    def _fused(self, views: dict, parts: list[tuple[Batch, list[int]]], picks: list[tuple]) -> bool:
        """apply_expert's work in one widen_kernel.expert call per batch, where it runs: a
        decode step's few rows (not a prefill's), weights widened (not native) and of a kind
        it reads, the SiLU gate. False: the caller computes it with torch."""
        gate_up, down = views["gate_up"], views["down"]
        if (self.native_rows or not self.silu or sum(len(p[0]) for p in picks) > widen_kernel.ROWS
                or not (widen_kernel.handles(gate_up) and widen_kernel.handles(down))
                or gate_up.dtype != down.dtype):
            return False
        for (b, _), (r, f) in zip(parts, picks):  # each batch adds to its own acc
            widen_kernel.expert(b.h, r, b.wflat.index_select(0, f), gate_up, down, views.get("gate_up_scale"),
                                views.get("down_scale"), b.acc)
        return True

    @torch.inference_mode()
    def advance(self, layer: int, parts: list[tuple[Batch, list[int]]]) -> Batch:
        """Close the layer for requests parts[j][1] (indexes into batch parts[j][0]), all of
        whose experts were applied: residual + (routed + shared); one Batch at `layer`."""
        xs, poss, states, ns = [], [], [], []
        for b, idx in parts:
            out = b.acc if b.shared is None else b.acc + b.shared
            if len(idx) == len(b.states):
                xs.append(b.x + out)
                poss.append(b.pos)
            else:
                starts = b.starts
                rows = torch.tensor([r for i in idx for r in range(starts[i], starts[i] + b.ns[i])],
                                    dtype=torch.long)
                xs.append(b.x.index_select(0, rows) + out.index_select(0, rows))
                poss.append(b.pos.index_select(0, rows))
            states += [b.states[i] for i in idx]
            ns += [b.ns[i] for i in idx]
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        pos = poss[0] if len(poss) == 1 else torch.cat(poss)
        return Batch(layer, states, ns, x, pos)

    @torch.inference_mode()
    def head(self, b: Batch, want: list[int]) -> torch.Tensor:
        """Close the pass of every request in b (its tokens join its past); logits
        [len(want), vocab] of the last position of the requests `want` (indexes into b)."""
        for s in b.states:
            s.held.extend(s.ids)
        if not want:
            return torch.empty(0)
        starts = b.starts
        last = torch.tensor([starts[i] + b.ns[i] - 1 for i in want], dtype=torch.long)
        x = self.model.model.norm(b.x.index_select(0, last))
        return self.model.lm_head(x)  # [len(want), vocab]


def _load_resident(model, path: Path, config) -> None:
    """Put rest.safetensors into the meta-device `model`, one tensor at a time: every
    nn.Linear and nn.Embedding becomes a Stored one over its tensor as stored (int8 ones
    with their `.qscale`), everything else (norms, routers, biases) a float32 parameter."""
    from engine.moe.convert import SCALE_SUFFIX

    with TensorFile(path) as f:  # anonymous copies, not mmap views: resident means resident
        names = set(f.keys())
        used: set[str] = set()

        def take(name: str) -> torch.Tensor | None:
            if name not in names:
                return None
            used.add(name)
            return f.get(name)

        for mname, module in list(model.named_modules()):
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                continue
            name = f"{mname}.weight"
            if name not in names:
                continue  # a tied head: set below
            used.add(name)
            # an untied input embedding is read a row per token: a view of the file, not a copy
            mapped = isinstance(module, torch.nn.Embedding) and not getattr(config, "tie_word_embeddings", False)
            weight = f.mapped(name) if mapped else f.get(name)
            scale = take(f"{mname}.weight{SCALE_SUFFIX}")
            if isinstance(module, torch.nn.Embedding):
                new = StoredEmbedding(weight, scale, mapped=mapped)
            else:
                bias = take(f"{mname}.bias")
                new = StoredLinear(weight, scale, bias)
            parent, _, leaf = mname.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
        state = {n: f.get(n).float() for n in names - used}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"unexpected weights in {REST_FILE}: {result.unexpected_keys[:5]}")
    head = model.lm_head
    if not isinstance(head, StoredLinear):
        if not getattr(config, "tie_word_embeddings", False):
            raise ValueError(f"lm_head.weight is missing from {REST_FILE}")
        emb = model.model.embed_tokens
        model.lm_head = StoredLinear(emb.weight, emb.scale)
    # RoPE tables are non-persistent buffers: rebuild them on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    meta += [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    if meta:
        raise ValueError(f"weights missing from {REST_FILE}: {meta[:5]}")


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    """The transformers RMSNorm `norm` (weight * x / rms(x), float32) as one fused op."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _window(config, layer: int) -> int | None:
    """Sliding-window size of `layer`'s attention, as transformers masks it (None: full)."""
    if config.model_type == "olmoe":
        return None
    types = getattr(config, "layer_types", None)
    if types:
        return getattr(config, "sliding_window", None) if types[layer] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def _act(config):
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(config, "hidden_act", "silu")]



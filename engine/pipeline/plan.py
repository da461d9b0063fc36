"""The pure partition planner: (model, peers, request) -> a pipeline plan.

A plan cuts a model's layers into contiguous half-open ranges ``[start, end)``,
one per peer, in ring order. Everything here is a pure function of plain,
frozen, JSON-serialisable data: no I/O, no clock, no randomness.

Cost model (per generated token, decode):
- Compute of a stage = bytes it reads / the device's effective bandwidth.
  Bytes = its layers' weights (at the requested precision), plus the final
  norm + LM head on the last stage. Decode is memory-bound, so this is a
  bandwidth model; a calibrated ``ms_per_layer_token`` turns into an effective
  bandwidth of ``mean layer bytes / ms``.
- Hop of a stage = the outgoing link's latency + bytes * 8 / bandwidth: the
  hidden state (``activation_bytes_per_token``) to the next stage, or a token
  id (``RETURN_BYTES``) from the last stage back to the first stage's peer,
  where the coordinator sits. The same peer talks over loopback.
- Stage time = compute + hop. Single-stream tok/s = 1000 / cycle, cycle = sum
  of stage times. With k interleaved streams, aggregate tok/s =
  min(k * 1000 / cycle, 1000 / bottleneck), bottleneck = max stage time; it
  reaches 1000 / bottleneck once k >= number of stages.
Memory of a stage (docs/planner.md has the measurements behind each number):
- weights: its layers (+ embeddings on stage 0, + head on the last) at the
  plan's precision, per tensor kind as the exporter writes them
  (``weight_bytes_of``: int4 groups of 128 + f16 scales, embedding/head and the
  shard's last MatMul in int8, norms f32);
- KV: elements/token/layer * context_length * streams * its layers * the
  bytes per element of the runtime's KV cache (``kv_element_bytes``: u8 +
  per-token scales on CPU by default, f32 in exact mode);
- runtime reserve: measured fixed memory of a worker process + the prefill
  chunk's activations and attention scores (``runtime_reserve``), + on a CPU
  the routed MoE experts' bytes once more (``EXPERT_COPIES``: the plugin ends
  up holding them twice);
- OS reserve: what the peer leaves to its OS and owner (``os_reserve``).
The constants and byte formulas live in ``plan_memory``; the search in ``plan_search``.
The sum must fit the peer's ``ram_free_bytes`` = min(free RAM, the agent's
sharing-policy cap). A weight precision of "auto" is resolved by
``choose_precision``: the checkpoint's own dtype if it fits, else int8, else
int4.

``auto_plan`` minimises the bottleneck exactly for every peer order (all
orders up to ``MAX_EXHAUSTIVE_PEERS`` peers, one speed-sorted order beyond) by
a DP over layer boundaries; among plans within a relative 1e-6 of the best
bottleneck it takes the fewest peers, then the smallest cycle, then the first
order in peer-id order. Checking and editing user plans (validate_plan,
evaluate_plan, move_boundary, exclude_peer, pin_device) live in ``plan_validate``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from engine.pipeline.plan_memory import (  # noqa: F401 - plan.X stays the public name of each
    AUTO, DEFAULT_HEAD_DIM, EMBEDDING_MAPPED, DEQUANT_COPIES, INT4_GROUP_SIZE, KV_DEFAULT_PRECISION, KV_PRECISION_BYTES,
    KV_U8_GROWTH, OS_RESERVE_FRACTION, OS_RESERVE_MIN_BYTES, PRECISION_BYTES, PRECISION_LADDERS, PRECISIONS,
    PREFILL_CHUNK, RUNTIME_RESERVE_BYTES, RUNTIME_RESERVE_FRACTION, SCALE_BYTES, SCORE_COPIES,
    U8_KV_SCALE_BYTES, VECTOR_BYTES, ZERO_POINT_BYTES, WeightCounts, _floats, _is_int, _is_num, _need,
    check_precision, embedding_mapped, embedding_table_bytes, expert_copies, kv_element_bytes, kv_growth, os_reserve, precision_ladder, prefill_scratch,
    weight_bytes_of)
from engine.pipeline.plan_search import MAX_EXHAUSTIVE_PEERS, REL_TIE, Search, StageSpec  # noqa: F401

DEVICE_KINDS = ("CPU", "GPU", "NPU")
# Effective decode bandwidth (bytes/s) when a device was never calibrated:
# conservative figures for an AI PC sharing LPDDR5 between CPU, iGPU and NPU.
DEFAULT_BANDWIDTH_BYTES_PER_S = {"CPU": 40e9, "GPU": 60e9, "NPU": 30e9}
RETURN_BYTES = 8  # the last stage sends a token id (+ header) back, not logits
DEFAULT_PREFERENCE = ("GPU", "NPU", "CPU")


class PlanError(ValueError):
    """No plan can be made or an edited plan is malformed; str(e) is for users."""

    def __init__(self, message: str, issues: Sequence[PlanIssue] = ()) -> None:
        super().__init__(message)
        self.issues = tuple(issues)  # the validation issues behind it, if any


# ---------------------------------------------------------------- helpers

def gb(nbytes: float) -> str:
    """Decimal gigabytes with one decimal: 41_234_000_000 -> '41.2 GB'."""
    return f"{nbytes / 1e9:.1f} GB"


def _from_dict(cls: type, d: Mapping[str, Any], **convert: Any) -> Any:
    """Build cls from a dict with exactly its fields; convert maps field -> fn."""
    _need(isinstance(d, Mapping), f"{cls.__name__} must be an object")
    names = [f.name for f in fields(cls)]
    extra = sorted(set(d) - set(names))
    _need(not extra, f"{cls.__name__}: unknown field(s) {', '.join(map(str, extra))}")
    kw = {k: (convert[k](v) if k in convert else v) for k, v in d.items()}
    try:
        return cls(**kw)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {e}") from None


def _tuple_of(item: Any) -> Any:
    def conv(v: Any) -> tuple:
        _need(isinstance(v, (list, tuple)), "expected a list")
        return tuple(item(x) for x in v)

    return conv


# ---------------------------------------------------------------- inputs
@dataclass(frozen=True)
class LinkProfile:
    latency_ms: float  # one-way latency of a small message, milliseconds
    bandwidth_mbit_s: float  # sustained throughput, megabits (1e6 bit) per second

    def __post_init__(self) -> None:
        _need(_is_num(self.latency_ms) and self.latency_ms >= 0, "latency_ms must be >= 0")
        _need(_is_num(self.bandwidth_mbit_s) and self.bandwidth_mbit_s > 0,
              "bandwidth_mbit_s must be > 0")
        _floats(self, "latency_ms", "bandwidth_mbit_s")

    def transfer_ms(self, nbytes: float) -> float:
        """Time to send nbytes: latency + serialisation."""
        return self.latency_ms + nbytes * 8 / (self.bandwidth_mbit_s * 1000.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkProfile:
        return _from_dict(cls, d)


DEFAULT_LINK = LinkProfile(1.0, 1000.0)  # an unknown pair of peers: gigabit LAN
LOOPBACK_LINK = LinkProfile(0.0, 100_000.0)  # a peer talking to itself

Links = Mapping[tuple[str, str], LinkProfile]


def link_between(links: Links | None, a: str, b: str) -> LinkProfile:
    """The link a -> b: loopback if a == b, else (a, b), else (b, a), else LAN."""
    if a == b:
        return LOOPBACK_LINK
    links = links or {}
    return links.get((a, b)) or links.get((b, a)) or DEFAULT_LINK


def links_to_list(links: Links) -> list[dict]:
    """JSON form of a link mapping, sorted by (from, to)."""
    return [{"from": a, "to": b, **links[(a, b)].to_dict()} for a, b in sorted(links)]


def links_from_list(items: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], LinkProfile]:
    out = {}
    for it in items:
        _need(isinstance(it, Mapping) and isinstance(it.get("from"), str)
              and isinstance(it.get("to"), str), "a link needs 'from' and 'to' peer ids")
        rest = {k: v for k, v in it.items() if k not in ("from", "to")}
        out[(it["from"], it["to"])] = LinkProfile.from_dict(rest)
    return out


@dataclass(frozen=True)
class DeviceProfile:
    kind: str  # "CPU" | "GPU" | "NPU"
    name: str  # OpenVINO device id, unique on its peer: "CPU", "GPU.0", "NPU"
    # Measured decode ms per average layer per token (calibration run at the
    # requested precision); None = estimate from bandwidth below.
    ms_per_layer_token: float | None = None
    # Effective memory bandwidth for the estimate, bytes/s; None = by kind.
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _need(self.kind in DEVICE_KINDS, f"device kind must be one of {', '.join(DEVICE_KINDS)}")
        _need(isinstance(self.name, str) and self.name != "", "device name must be non-empty")
        for n in ("ms_per_layer_token", "bandwidth_bytes_per_s"):
            v = getattr(self, n)
            _need(v is None or (_is_num(v) and v > 0), f"{n} must be > 0 or null")
            _floats(self, n)

    def bytes_per_ms(self, mean_layer_bytes: float) -> float:
        """Effective bandwidth in bytes per millisecond."""
        if self.ms_per_layer_token is not None:
            return mean_layer_bytes / self.ms_per_layer_token
        bw = self.bandwidth_bytes_per_s or DEFAULT_BANDWIDTH_BYTES_PER_S[self.kind]
        return bw / 1000.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceProfile:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class PeerProfile:
    peer_id: str  # stable node id (mDNS TXT)
    name: str  # human name shown in the UI, e.g. "laptop-2"
    devices: tuple[DeviceProfile, ...]  # OpenVINO devices it offers
    # min(free RAM now, its agent's sharing-policy cap): what the stage must fit, the OS
    # reserve included (the planner adds that reserve to the stage's need)
    ram_free_bytes: int
    ram_total_bytes: int = 0  # installed RAM (sizes the OS reserve); 0 = unknown: ram_free_bytes

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and self.peer_id != "", "peer_id must be non-empty")
        _need(isinstance(self.name, str), "peer name must be a string")
        object.__setattr__(self, "devices", tuple(self.devices))
        _need(all(isinstance(d, DeviceProfile) for d in self.devices), "devices must be DeviceProfile")
        names = [d.name for d in self.devices]
        _need(len(set(names)) == len(names), f"peer {self.peer_id}: device names repeat")
        _need(_is_int(self.ram_free_bytes) and self.ram_free_bytes >= 0, "ram_free_bytes must be >= 0")
        _need(_is_int(self.ram_total_bytes) and self.ram_total_bytes >= 0, "ram_total_bytes must be >= 0")

    def device(self, name: str) -> DeviceProfile | None:
        return next((d for d in self.devices if d.name == name), None)

    def os_reserve_bytes(self) -> int:
        return os_reserve(self.ram_total_bytes or self.ram_free_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "devices": [d.to_dict() for d in self.devices]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerProfile:
        return _from_dict(cls, d, devices=_tuple_of(DeviceProfile.from_dict))


_LABEL_OF_BYTES = {4.0: "f32", 2.0: "bf16"}  # a profile that names no dtype: its width's usual label


@dataclass(frozen=True)
class PlanModel:
    model_id: str  # shown in messages
    num_layers: int  # transformer blocks L; ranges cover [0, L)
    hidden_size: int  # width of the hidden state
    bytes_per_layer: tuple[int, ...]  # weight bytes of each block at dtype_bytes (the checkpoint)
    embedding_bytes: int  # token embeddings, held by stage 0
    head_bytes: int  # final norm + LM head, held (and read per token) by the last stage
    kv_elements_per_token_per_layer: int  # K + V elements of one token in one layer (2 x kv heads x head dim)
    dtype_bytes: float = 2.0  # bytes per element of the checkpoint's weights (bf16 = 2)
    activation_bytes_per_token: int = 0  # hidden state sent per hop; 0 = hidden_size * 4
    checkpoint_precision: str = ""  # the checkpoint's dtype label; "" = by dtype_bytes (4 f32, 2 bf16)
    # Parameter counts (engine.models.ModelProfile): weights at any precision per tensor kind.
    # Empty / None: every byte above is taken for a matrix element at dtype_bytes.
    layer_params: tuple[WeightCounts, ...] = ()  # per layer
    embedding_params: WeightCounts | None = None  # embedding tables
    head_params: WeightCounts | None = None  # LM head + final norm
    layer_tail_params: WeightCounts = WeightCounts()  # a layer's last MatMul (int8 ending an int4 shard)
    head_dim: int = DEFAULT_HEAD_DIM  # per KV head width (u8 KV scales are per head)
    num_heads: int = 0  # query heads (prefill attention scores); 0 = hidden_size / head_dim
    intermediate_size: int = 0  # MLP width (prefill activations); 0 = 4 x hidden_size
    max_context: int = 0  # the model's maximum context; 0 = unknown (no clipping)
    # The routed experts' part of each layer's parameters (MoE; zeros for a dense layer).
    # Empty: a dense model. The CPU runtime holds these twice (plan_memory.EXPERT_COPIES).
    layer_expert_params: tuple[WeightCounts, ...] = ()

    def __post_init__(self) -> None:
        _need(isinstance(self.model_id, str), "model_id must be a string")
        _need(_is_int(self.num_layers) and self.num_layers >= 1, "num_layers must be >= 1")
        _need(_is_int(self.hidden_size) and self.hidden_size >= 1, "hidden_size must be >= 1")
        object.__setattr__(self, "bytes_per_layer", tuple(self.bytes_per_layer))
        _need(len(self.bytes_per_layer) == self.num_layers,
              f"bytes_per_layer has {len(self.bytes_per_layer)} entries for {self.num_layers} layers")
        _need(all(_is_int(b) and b > 0 for b in self.bytes_per_layer), "layer bytes must be > 0")
        for n in ("embedding_bytes", "head_bytes", "kv_elements_per_token_per_layer",
                  "activation_bytes_per_token", "num_heads", "intermediate_size", "max_context"):
            _need(_is_int(getattr(self, n)) and getattr(self, n) >= 0, f"{n} must be an int >= 0")
        _need(_is_int(self.head_dim) and self.head_dim >= 1, "head_dim must be >= 1")
        _need(_is_num(self.dtype_bytes) and self.dtype_bytes > 0, "dtype_bytes must be > 0")
        _floats(self, "dtype_bytes")
        if self.activation_bytes_per_token == 0:
            object.__setattr__(self, "activation_bytes_per_token", self.hidden_size * 4)
        if not self.checkpoint_precision:
            object.__setattr__(self, "checkpoint_precision", _LABEL_OF_BYTES.get(self.dtype_bytes, "f32"))
        _need(self.checkpoint_precision in PRECISION_BYTES,
              f"checkpoint_precision must be one of {', '.join(PRECISIONS)}")
        object.__setattr__(self, "layer_params", tuple(WeightCounts.of(c) for c in self.layer_params))
        _need(not self.layer_params or len(self.layer_params) == self.num_layers,
              f"layer_params has {len(self.layer_params)} entries for {self.num_layers} layers")
        for n in ("embedding_params", "head_params"):
            if getattr(self, n) is not None:
                object.__setattr__(self, n, WeightCounts.of(getattr(self, n)))
        object.__setattr__(self, "layer_tail_params", WeightCounts.of(self.layer_tail_params))
        object.__setattr__(self, "layer_expert_params", tuple(WeightCounts.of(c) for c in self.layer_expert_params))
        _need(not self.layer_expert_params or len(self.layer_expert_params) == self.num_layers,
              f"layer_expert_params has {len(self.layer_expert_params)} entries for {self.num_layers} layers")

    # -- weights per tensor kind at a precision
    def _as_matrix(self, nbytes: int) -> WeightCounts:
        return WeightCounts(matrix=math.ceil(nbytes / self.dtype_bytes))

    def layer_counts(self, i: int) -> WeightCounts:
        return self.layer_params[i] if self.layer_params else self._as_matrix(self.bytes_per_layer[i])

    def layer_weight_bytes(self, precision: str) -> list[int]:
        """Bytes of each layer in a shard at precision."""
        return [weight_bytes_of(self.layer_counts(i), precision) for i in range(self.num_layers)]

    def expert_weight_bytes(self, precision: str) -> list[int]:
        """Bytes of each layer's routed experts in a shard at precision (all 0 for a dense model)."""
        if not self.layer_expert_params:
            return [0] * self.num_layers
        return [weight_bytes_of(c, precision) for c in self.layer_expert_params]

    def embedding_weight_bytes(self, precision: str) -> int:
        """Embedding tables at precision; int4 keeps them int8 (NNCF's backup mode)."""
        c = self.embedding_params if self.embedding_params is not None else self._as_matrix(self.embedding_bytes)
        return weight_bytes_of(c, precision, int8_backup=True)

    def head_weight_bytes(self, precision: str) -> int:
        """Final norm + LM head at precision; int4 keeps the head int8 (the graph's last MatMul)."""
        c = self.head_params if self.head_params is not None else self._as_matrix(self.head_bytes)
        return weight_bytes_of(c, precision, int8_backup=True)

    def tail_extra_bytes(self, precision: str) -> int:
        """What a shard that does not end with the head pays at int4 for its last MatMul in int8."""
        if precision != "int4":
            return 0
        t = self.layer_tail_params
        return weight_bytes_of(t, "int4", int8_backup=True) - weight_bytes_of(t, "int4")

    @property
    def query_heads(self) -> int:
        return self.num_heads or max(1, self.hidden_size // self.head_dim)

    @classmethod
    def from_profile(cls, profile: Any) -> PlanModel:
        """Adapt an engine.models.profile.ModelProfile (or its dict) by duck typing."""
        def g(name: str, default: Any = None) -> Any:
            if isinstance(profile, Mapping):
                return profile.get(name, default)
            return getattr(profile, name, default)

        n = int(g("num_layers"))
        dtype = float(g("dtype_bytes") or 2)
        emb, head = int(g("embedding_bytes") or 0), int(g("head_bytes") or 0)
        per = tuple(int(b) for b in (g("bytes_per_layer") or ()))
        if not per:  # only a total: spread the rest evenly
            rest = max(n, int(g("total_bytes") or 0) - emb - head)
            per = tuple(rest // n + (1 if i < rest % n else 0) for i in range(n))
        heads = int(g("num_kv_heads") or g("num_heads") or 0)
        head_dim = int(g("head_dim") or 0)
        kv_el = g("kv_elements_per_token")
        if kv_el is None and heads and head_dim:
            kv_el = 2 * n * heads * head_dim
        kv_layer = -(-int(kv_el or 0) // n)
        hidden = int(g("hidden_size"))
        layers = tuple(WeightCounts.of(c) for c in (g("layer_params") or ()))
        has = bool(layers) and len(layers) == n
        label = str(g("dtype") or "")
        opt = {k: WeightCounts.of(g(k)) for k in ("embedding_params", "head_params", "layer_tail_params")
               if has and g(k) is not None}
        return cls(model_id=str(g("model_id", "")), num_layers=n, hidden_size=hidden,
                   bytes_per_layer=per, embedding_bytes=emb, head_bytes=head,
                   kv_elements_per_token_per_layer=kv_layer, dtype_bytes=dtype,
                   activation_bytes_per_token=hidden * 4,
                   checkpoint_precision=label if label in PRECISION_BYTES else "",
                   layer_params=layers if has else (), head_dim=head_dim or DEFAULT_HEAD_DIM,
                   num_heads=int(g("num_heads") or 0), intermediate_size=int(g("intermediate_size") or 0),
                   max_context=int(g("max_context") or 0),
                   layer_expert_params=_expert_counts(g("experts"), n, hidden, dtype), **opt)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes_per_layer"] = list(self.bytes_per_layer)
        d["layer_params"] = [asdict(c) for c in self.layer_params]
        d["layer_expert_params"] = [asdict(c) for c in self.layer_expert_params]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanModel:
        opt = lambda v: None if v is None else WeightCounts.of(v)  # noqa: E731
        return _from_dict(cls, d, bytes_per_layer=_tuple_of(lambda x: x),
                          layer_params=_tuple_of(WeightCounts.of), embedding_params=opt,
                          layer_expert_params=_tuple_of(WeightCounts.of),
                          head_params=opt, layer_tail_params=WeightCounts.of)


def _expert_counts(experts: Any, num_layers: int, hidden: int, dtype_bytes: float) -> tuple[WeightCounts, ...]:
    """Per-layer routed-expert parameters from a profile's ExpertInfo (or its dict); () if dense.
    An expert is gate + up [I, H] and down [H, I]: I from its bytes, its rows 2I + H."""
    if not experts:
        return ()
    g = experts.get if isinstance(experts, Mapping) else (lambda k, d=None: getattr(experts, k, d))
    n, per = int(g("num_experts") or 0), int(g("bytes_per_expert") or 0)
    if n <= 0 or per <= 0 or hidden <= 0:
        return ()
    matrix = math.ceil(per / dtype_bytes)
    inter = max(1, matrix // (3 * hidden))
    one = WeightCounts(matrix=n * matrix, rows=n * (2 * inter + hidden))
    moe = {int(i) for i in (g("moe_layers") or ())}
    return tuple(one if i in moe else WeightCounts() for i in range(num_layers))


@dataclass(frozen=True)
class PlanRequest:
    # tokens of KV reserved per stream; None = DEFAULT_CONTEXT clipped to the model's maximum
    context_length: int | None = None
    streams: int = 1  # concurrent streams; each keeps its own KV on every stage
    kv_dtype_bytes: float | None = None  # bytes per KV element; None = kv_element_bytes(device, exact)
    weight_precision: str = AUTO  # "auto" (choose_precision) or a PRECISIONS label
    exact: bool = False  # workers run exact (f32 math + f32 KV cache, LoadRequest.exact)
    runtime_reserve_bytes: int = RUNTIME_RESERVE_BYTES  # measured fixed memory of a worker
    runtime_reserve_fraction: float = RUNTIME_RESERVE_FRACTION  # + this fraction of its weights
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill call (sizes its activations); 0 = none
    os_reserve_bytes: int | None = None  # left to each peer's OS; None = os_reserve(the peer's RAM)

    def __post_init__(self) -> None:
        _need(self.context_length is None or (_is_int(self.context_length) and self.context_length >= 1),
              "context_length must be >= 1 or null")
        _need(_is_int(self.streams) and self.streams >= 1, "streams must be >= 1")
        _need(self.kv_dtype_bytes is None or (_is_num(self.kv_dtype_bytes) and self.kv_dtype_bytes > 0),
              "kv_dtype_bytes must be > 0 or null")
        _need(isinstance(self.exact, bool), "exact must be a bool")
        _need(_is_int(self.runtime_reserve_bytes) and self.runtime_reserve_bytes >= 0,
              "runtime_reserve_bytes must be >= 0")
        _need(_is_num(self.runtime_reserve_fraction) and 0 <= self.runtime_reserve_fraction < 1,
              "runtime_reserve_fraction must be in [0, 1)")
        _need(_is_int(self.prefill_chunk) and self.prefill_chunk >= 0, "prefill_chunk must be >= 0")
        _need(self.os_reserve_bytes is None or (_is_int(self.os_reserve_bytes) and self.os_reserve_bytes >= 0),
              "os_reserve_bytes must be >= 0 or null")
        check_precision(self.weight_precision, allow_auto=True)
        _floats(self, "kv_dtype_bytes", "runtime_reserve_fraction")

    def context_for(self, model: PlanModel) -> int:
        """The context this request sizes KV for on model."""
        if self.context_length is not None:
            return self.context_length
        from engine.models.profile import default_context

        return default_context(model.max_context)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanRequest:
        return _from_dict(cls, d)


# ---------------------------------------------------------------- outputs
@dataclass(frozen=True)
class FitHint:
    """One computed change that makes a plan fit (PlanIssue.hints, most useful first)."""

    code: str  # "weights" | "context" | "streams" | "add_peer"
    message: str  # a few words for the user: "int4 weights", "a 2048-token context"
    weight_precision: str | None = None  # "weights": the precision that fits
    context_length: int | None = None  # "context": the longest context that fits (tokens)
    streams: int | None = None  # "streams": the most streams that fit
    ram_bytes: int | None = None  # "add_peer": memory another peer must share for it to fit

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FitHint:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class PlanIssue:
    stage: int | None  # index of the stage it concerns; None = the whole plan
    code: str  # machine tag: empty_plan, empty_range, out_of_range, gap, overlap, memory, ...
    message: str  # one precise sentence for the user
    shortfall_bytes: int = 0  # memory: bytes missing (need - what the peer or fleet shares)
    hints: tuple[FitHint, ...] = ()  # memory: what would make it fit, computed

    def to_dict(self) -> dict:
        return {**asdict(self), "hints": [h.to_dict() for h in self.hints]}


@dataclass(frozen=True)
class Stage:
    peer_id: str  # peer that runs it
    device: str  # device name on that peer ("GPU.0")
    start: int  # first layer (inclusive)
    end: int  # last layer + 1 (exclusive)
    weight_bytes: int  # its layers (+ embeddings if first, + head if last) at the precision: the shard
    kv_bytes: int  # KV for context_length * streams tokens over its layers, at the runtime's KV width
    runtime_reserve_bytes: int  # the worker's own memory: fixed part + prefill activations
    os_reserve_bytes: int  # left to the peer's OS and owner
    total_bytes: int  # weight + kv + runtime + OS reserve
    ram_free_bytes: int  # what the peer shares: min(free RAM, its policy cap)
    fits: bool  # total_bytes <= ram_free_bytes
    compute_ms: float  # predicted compute per token
    hop_ms: float  # predicted outgoing transfer per token
    predicted_ms_per_token: float  # compute + hop
    predicted_tok_s: float  # 1000 / predicted_ms_per_token: the stage's own cap
    # The part of weight_bytes the device reads in place from the mapped shard file (a CPU
    # stage 0's embedding table, plan_memory.EMBEDDING_MAPPED): on disk, not in total_bytes.
    mapped_bytes: int = 0

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and isinstance(self.device, str), "bad stage peer/device")
        for n in ("start", "end", "weight_bytes", "kv_bytes", "runtime_reserve_bytes", "os_reserve_bytes",
                  "total_bytes", "ram_free_bytes", "mapped_bytes"):
            _need(_is_int(getattr(self, n)), f"stage {n} must be an int")
        _need(isinstance(self.fits, bool), "stage fits must be a bool")
        for n in ("compute_ms", "hop_ms", "predicted_ms_per_token", "predicted_tok_s"):
            _need(_is_num(getattr(self, n)), f"stage {n} must be a number")
        _floats(self, "compute_ms", "hop_ms", "predicted_ms_per_token", "predicted_tok_s")

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def margin_bytes(self) -> int:
        """Both reserves (runtime + OS): the memory bar's third segment."""
        return self.runtime_reserve_bytes + self.os_reserve_bytes

    @property
    def resident_weight_bytes(self) -> int:
        """Weights the worker holds in its own memory: the shard but what stays mapped."""
        return self.weight_bytes - self.mapped_bytes

    @property
    def process_bytes(self) -> int:
        """The worker process's predicted peak (anonymous memory): resident weights + KV + runtime reserve."""
        return self.resident_weight_bytes + self.kv_bytes + self.runtime_reserve_bytes

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.total_bytes - self.ram_free_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class Plan:
    model_id: str  # the model it partitions
    stages: tuple[Stage, ...]  # in ring order; stage 0 holds embeddings, the last the head
    weight_precision: str  # the concrete precision the shards are exported at ("auto" resolved)
    context_length: int  # tokens of KV reserved per stream
    streams: int  # concurrent streams the KV was sized for
    bottleneck_ms: float  # max stage time per token
    cycle_ms: float  # sum of stage times: one token of one stream around the ring
    predicted_tok_s: float  # single stream: 1000 / cycle_ms
    predicted_aggregate_tok_s: float  # min(streams * 1000 / cycle, 1000 / bottleneck)
    fits: bool  # every stage fits its peer
    exact: bool = False  # workers run exact (f32 math + KV): what the KV was sized at

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        _need(all(isinstance(s, Stage) for s in self.stages), "plan stages must be Stage")
        check_precision(self.weight_precision)
        _floats(self, "bottleneck_ms", "cycle_ms", "predicted_tok_s", "predicted_aggregate_tok_s")

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(s.peer_id for s in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Layer where each stage after the first starts."""
        return tuple(s.start for s in self.stages[1:])

    def to_dict(self) -> dict:
        return {**asdict(self), "stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        return _from_dict(cls, d, stages=_tuple_of(Stage.from_dict))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))




def stage_specs(plan_or_stages: Any) -> list[StageSpec]:
    """(peer_id, device, start, end) of a Plan, Stages, dicts or 4-tuples."""
    items = plan_or_stages.stages if isinstance(plan_or_stages, Plan) else plan_or_stages
    out = []
    for it in items or ():
        if isinstance(it, Stage):
            out.append((it.peer_id, it.device, it.start, it.end))
        elif isinstance(it, Mapping):
            out.append((it.get("peer_id"), it.get("device"), it.get("start"), it.get("end")))
        else:
            out.append(tuple(it))
    return out


# ---------------------------------------------------------------- cost model
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


# ---------------------------------------------------------------- search

def auto_plan(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
              links: Links | None = None, device_preference: Sequence[str] = DEFAULT_PREFERENCE,
              pinned_devices: Mapping[str, str] | None = None) -> Plan:
    """The plan with the smallest bottleneck, then fewest peers, then smallest cycle.

    Each peer runs on its fastest device among the kinds in device_preference
    (ties: earlier kind) unless pinned_devices names one. A weight precision of
    "auto" is resolved by choose_precision. Raises PlanError when nothing fits:
    its message and its issue say what is needed, what the fleet shares, and
    what would make it fit (PlanIssue.hints).
    """
    if request.weight_precision == AUTO:
        return choose_precision(model, peers, request, links, device_preference, pinned_devices)[1]
    return _plan_at(model, peers, request, links, device_preference, pinned_devices, explain=True)


def choose_precision(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
                     links: Links | None = None, device_preference: Sequence[str] = DEFAULT_PREFERENCE,
                     pinned_devices: Mapping[str, str] | None = None,
                     specs: Sequence[StageSpec] | None = None) -> tuple[str, Plan]:
    """(precision, plan) at the most precise weights that fit: for "auto" the
    checkpoint's own dtype, else int8, else int4 (precision_ladder); a concrete
    request precision is the only one tried.

    specs None: auto_plan at each precision; PlanError (with hints) when even the
    last does not fit. specs given (a user's stages): the first precision at which
    every stage fits, else the last one's plan with its stages marked fits=False.
    """
    asked = request.weight_precision
    ladder = precision_ladder(model.checkpoint_precision) if asked == AUTO else (check_precision(asked),)
    plan: Plan | None = None
    for i, label in enumerate(ladder):
        req = replace(request, weight_precision=label)
        if specs is not None:
            from engine.pipeline.plan_validate import evaluate_plan

            plan = evaluate_plan(specs, model, peers, req, links)
            if plan.fits:
                return label, plan
            continue
        try:
            return label, _plan_at(model, peers, req, links, device_preference, pinned_devices,
                                   explain=i == len(ladder) - 1)
        except PlanError as e:
            if i == len(ladder) - 1:
                if len(ladder) > 1:
                    raise PlanError(f"{e} (auto tried weights {', '.join(ladder)})", e.issues) from None
                raise
    assert plan is not None
    return ladder[-1], plan


def _plan_at(model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
             links: Links | None, device_preference: Sequence[str],
             pinned_devices: Mapping[str, str] | None, explain: bool) -> Plan:
    """auto_plan at the request's concrete precision; explain: hints in the PlanError."""
    fleet = _Fleet(model, peers, request, links)
    pinned = dict(pinned_devices or {})
    unknown = sorted(set(pinned) - set(fleet.peers))
    if unknown:
        raise PlanError(f"cannot pin a device on unknown peer {', '.join(unknown)}")
    devices = {}
    for pid in fleet.peers:
        d = fleet.best_device(pid, device_preference, pinned)
        if d is not None:
            devices[pid] = d
    search = Search(fleet, devices)
    per_m = search.bottlenecks() if devices else {}
    finite = {m: b for m, b in per_m.items() if math.isfinite(b)}
    if not finite:
        if not explain:
            raise PlanError(f"{model.model_id or 'the model'} does not fit the fleet")
        from engine.pipeline.plan_validate import infeasible_error

        def retry(req: PlanRequest, extra: Sequence[PeerProfile] = ()) -> bool:
            try:
                _plan_at(model, [*peers, *extra], req, links, device_preference, pinned, explain=False)
                return True
            except PlanError:
                return False

        raise infeasible_error(fleet, devices, device_preference, retry)
    best = min(finite.values())
    m = min(k for k, b in finite.items() if b <= best * (1 + REL_TIE))
    limit = max(finite[m], best) * (1 + REL_TIE)
    return fleet.build(search.cheapest(m, limit))

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
  chunk's activations and attention scores (``runtime_reserve``);
- OS reserve: what the peer leaves to its OS and owner (``os_reserve``).
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

DEVICE_KINDS = ("CPU", "GPU", "NPU")
# Effective decode bandwidth (bytes/s) when a device was never calibrated:
# conservative figures for an AI PC sharing LPDDR5 between CPU, iGPU and NPU.
DEFAULT_BANDWIDTH_BYTES_PER_S = {"CPU": 40e9, "GPU": 60e9, "NPU": 30e9}
# Weight precision labels, agreed across the team (exporter, planner, UI), most precise first.
PRECISIONS = ("f32", "bf16", "fp16", "int8", "int4")
AUTO = "auto"  # a request's "the most precise that fits" (choose_precision)
# Bytes per element of a weight matrix at each precision, before scales (see weight_bytes_of).
PRECISION_BYTES = {"f32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
# What "auto" tries for a checkpoint of each dtype, most precise first: its own dtype
# (never f32 for a half checkpoint: twice the bytes, no better), then int8, then int4.
# fp16 after f32 halves an f32 checkpoint at no real loss; fp16 after bf16 is the same
# size, so it cannot fit where bf16 does not.
PRECISION_LADDERS = {"f32": ("f32", "fp16", "int8", "int4"), "bf16": ("bf16", "int8", "int4"),
                     "fp16": ("fp16", "int8", "int4")}
# How engine/pipeline/compress.py (NNCF) stores compressed weights, read back from exported
# demo shards (Constant types and shapes of the IR):
#   int8  INT8_ASYM per output channel: u8 [out, in] + f16 scale [out, 1] + u8 zero point [out, 1]
#   int4  INT4_SYM, groups of 128 input channels: i4 [out, in/128, 128] + f16 scale [out, in/128, 1];
#         NNCF's backup mode keeps the embedding (Gather), the LM head and whatever MatMul ends
#         the shard's graph in int8 (a middle or first shard: its last layer's down projection)
#   f32/bf16/fp16 weights at 4/2/2 bytes; norm weights and biases stay f32 in the IR (tiny).
INT4_GROUP_SIZE = 128  # compress.INT4_GROUP_SIZE (a layer whose width is no multiple shrinks it: a few % more scales)
SCALE_BYTES = 2  # one f16 scale per int4 group / int8 output channel
ZERO_POINT_BYTES = 1  # one u8 zero point per int8 output channel (asymmetric)
VECTOR_BYTES = 4  # 1-D weights (norms, biases) in the IR
RETURN_BYTES = 8  # the last stage sends a token id (+ header) back, not logits
MAX_EXHAUSTIVE_PEERS = 6  # try every peer order up to this many peers
DEFAULT_PREFERENCE = ("GPU", "NPU", "CPU")
_REL_TIE = 1e-6  # bottlenecks within this relative distance are a tie

# ---------------------------------------------------------------- memory model
# KV cache element type each device's plugin picks when the model does not say
# (the IR's rt_info runtime_options; our shards carry none, optimum-intel IRs say f16
# for unquantized models). Measured on this machine (OpenVINO 2026.4, AVX2 EPYC, no bf16):
# a compiled shard reports KV_CACHE_PRECISION u8 by default, f32 with our exact mode
# (INFERENCE_PRECISION_HINT=f32 + KV_CACHE_PRECISION=f32). GPU and NPU are f16 by their
# plugins' documented defaults (not measured here: no such device).
KV_DEFAULT_PRECISION = {"CPU": "u8", "GPU": "f16", "NPU": "f16"}
KV_PRECISION_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "u8": 1.0, "i8": 1.0}
# u8 KV keeps, per token, per head and for K and V alike, an f32 scale and an f32 zero
# point (KEY/VALUE_CACHE_GROUP_SIZE 0 = one group per head): 8 bytes per head_dim elements.
U8_KV_SCALE_BYTES = 8
DEFAULT_HEAD_DIM = 128  # when a model does not say (Llama, Qwen, Mistral)

# Runtime reserve of one worker: anonymous memory beyond its weights and KV. Measured with
# engine/bench/_reserve.py (docs/planner.md) on middle shards of 205 MB-822 MB: a fresh
# python + openvino (27 MB), the compiled shard and one 16-token inference hold 42-94 MB
# beyond the shard file, whatever the precision and size (the CPU plugin repacks the
# weights once: ~1.0 x the file, no part grows with them); the worker's own imports add 3 MB.
RUNTIME_RESERVE_BYTES = 100_000_000
RUNTIME_RESERVE_FRACTION = 0.0  # of the weights (measured ~0 beyond the 1.0 x copy)
# Memory that grows with the context, measured with KV sweeps (prefill in 512-token chunks
# to 4096 tokens, RssAnon per chunk; docs/planner.md) on two models that differ only in KV
# heads (16 vs 2), u8 and exact f32 KV; the model below predicts their peaks within -4..+10 %:
# - attention scores of a prefill chunk: SCORE_COPIES x f32 [heads, chunk, context]
#   (one prefill at a time per worker: not per stream);
# - u8 KV only: the past K and V of the layer being prefilled, dequantized to f32
#   (DEQUANT_COPIES x 2 x kv_heads x head_dim x 4 bytes per token of context);
# - u8 KV only: the cache grows by doubling and the replaced block stays resident, so
#   right after a doubling it holds up to KV_U8_GROWTH x its nominal size (f32 KV grew
#   smoothly: 4.0 bytes per element, no doubling jump);
# - the MLP's [chunk, intermediate] f32 activations (gate and up).
PREFILL_CHUNK = 512  # tokens per prefill call (the coordinator's prefill_chunk)
SCORE_COPIES = 1.5  # fitted 1.3 (u8 runs) and 1.5 (f32 runs): the larger
DEQUANT_COPIES = 1.25  # fitted on the u8 runs
KV_U8_GROWTH = 2.0
# OS reserve: RAM a peer leaves to its OS and owner on top of what is free now. Free
# RAM (MemAvailable) counts every reclaimable cache page as free; taking all of it
# evicts the code and files the desktop and the owner's idle programs need (they keep
# allocating while the PC is shared), and the shard's own IR file pages are read
# through that cache at load. 10 % of RAM, at least 1 GB: 1 GB on an 8 GB laptop,
# 3.2 GB on a 32 GB desktop.
OS_RESERVE_MIN_BYTES = 1_000_000_000
OS_RESERVE_FRACTION = 0.10


def check_precision(label: str, allow_auto: bool = False) -> str:
    """label if it is a precision label (or "auto" when allowed), else ValueError."""
    ok = label in PRECISION_BYTES or (allow_auto and label == AUTO)
    _need(ok, f"weight_precision must be {'auto or ' if allow_auto else ''}one of {', '.join(PRECISIONS)}")
    return label


def precision_ladder(checkpoint: str) -> tuple[str, ...]:
    """The precisions "auto" tries for a checkpoint of this dtype, most precise first."""
    return PRECISION_LADDERS.get(checkpoint, PRECISION_LADDERS["f32"])


def kv_element_bytes(device_kind: str, exact: bool = False, *, head_dim: int = DEFAULT_HEAD_DIM,
                     ir_precision: str | None = None) -> float:
    """Bytes one K or V element costs in the runtime's KV cache, its scales included.

    exact: the worker runs in exact mode (f32 KV). ir_precision: the IR's own
    runtime_options KV_CACHE_PRECISION ("f16", "u8"), which the plugin honours
    over its default; None for our shards."""
    if exact:
        return KV_PRECISION_BYTES["f32"]
    prec = ir_precision or KV_DEFAULT_PRECISION.get(device_kind, "f16")
    if prec in ("u8", "i8"):
        return 1.0 + U8_KV_SCALE_BYTES / max(1, head_dim)
    return KV_PRECISION_BYTES.get(prec, 4.0)


def os_reserve(ram_total_bytes: int) -> int:
    """What a peer with ram_total_bytes of RAM leaves to its OS and owner."""
    return max(OS_RESERVE_MIN_BYTES, math.ceil(OS_RESERVE_FRACTION * max(0, ram_total_bytes)))


def prefill_scratch(num_heads: int, intermediate: int, context_length: int,
                    chunk: int = PREFILL_CHUNK, dequant_kv_elements: int = 0) -> int:
    """Activations of one prefill chunk at the end of the context, bytes: attention scores,
    the MLP's intermediates and (u8 KV) one layer's past K + V dequantized to f32
    (dequant_kv_elements = K + V elements per token of that layer)."""
    c = min(chunk, context_length)
    scores = SCORE_COPIES * num_heads * c * context_length
    return math.ceil(4 * (scores + 2 * c * intermediate + DEQUANT_COPIES * dequant_kv_elements * context_length))


def kv_growth(device_kind: str, exact: bool = False) -> float:
    """Peak KV memory / its nominal size (u8 CPU cache: grows by doubling)."""
    return KV_U8_GROWTH if not exact and KV_DEFAULT_PRECISION.get(device_kind) == "u8" else 1.0


class PlanError(ValueError):
    """No plan can be made or an edited plan is malformed; str(e) is for users."""

    def __init__(self, message: str, issues: Sequence[PlanIssue] = ()) -> None:
        super().__init__(message)
        self.issues = tuple(issues)  # the validation issues behind it, if any


# ---------------------------------------------------------------- helpers
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise ValueError(why)


def _floats(obj: object, *names: str) -> None:
    """Store ints given for float fields as floats, so round trips compare equal."""
    for n in names:
        v = getattr(obj, n)
        if _is_int(v):
            object.__setattr__(obj, n, float(v))


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


@dataclass(frozen=True)
class WeightCounts:
    """Parameters of some weight tensors, by how the exporter stores them."""

    matrix: int = 0  # elements of 2-D+ tensors (Linear weights, embedding tables): int8/int4 compress these
    rows: int = 0  # their output channels: int8 keeps one scale + zero point per row
    vector: int = 0  # elements of 1-D tensors (norm weights, biases): f32 in the IR

    def __post_init__(self) -> None:
        for n in ("matrix", "rows", "vector"):
            _need(_is_int(getattr(self, n)) and getattr(self, n) >= 0, f"weight count {n} must be an int >= 0")

    @classmethod
    def of(cls, v: Any) -> WeightCounts:
        """From a WeightCounts, a ModelProfile ParamCounts or their dict."""
        if isinstance(v, WeightCounts):
            return v
        get = v.get if isinstance(v, Mapping) else (lambda k, d=0: getattr(v, k, d))
        return cls(int(get("matrix", 0)), int(get("rows", 0)), int(get("vector", 0)))


def weight_bytes_of(counts: WeightCounts, precision: str, int8_backup: bool = False) -> int:
    """Bytes of these weights in an IR at precision (int8_backup: int4's int8 exceptions)."""
    m = counts.matrix
    if precision == "int4" and not int8_backup:
        mat = m * PRECISION_BYTES["int4"] + SCALE_BYTES * math.ceil(m / INT4_GROUP_SIZE)
    elif precision in ("int8", "int4"):
        mat = m * PRECISION_BYTES["int8"] + (SCALE_BYTES + ZERO_POINT_BYTES) * counts.rows
    else:
        mat = m * PRECISION_BYTES[precision]
    return math.ceil(mat + VECTOR_BYTES * counts.vector)


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

    # -- weights per tensor kind at a precision
    def _as_matrix(self, nbytes: int) -> WeightCounts:
        return WeightCounts(matrix=math.ceil(nbytes / self.dtype_bytes))

    def layer_counts(self, i: int) -> WeightCounts:
        return self.layer_params[i] if self.layer_params else self._as_matrix(self.bytes_per_layer[i])

    def layer_weight_bytes(self, precision: str) -> list[int]:
        """Bytes of each layer in a shard at precision."""
        return [weight_bytes_of(self.layer_counts(i), precision) for i in range(self.num_layers)]

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
                   max_context=int(g("max_context") or 0), **opt)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes_per_layer"] = list(self.bytes_per_layer)
        d["layer_params"] = [asdict(c) for c in self.layer_params]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanModel:
        opt = lambda v: None if v is None else WeightCounts.of(v)  # noqa: E731
        return _from_dict(cls, d, bytes_per_layer=_tuple_of(lambda x: x),
                          layer_params=_tuple_of(WeightCounts.of), embedding_params=opt,
                          head_params=opt, layer_tail_params=WeightCounts.of)


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
    weight_bytes: int  # its layers (+ embeddings if first, + head if last) at the precision
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

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and isinstance(self.device, str), "bad stage peer/device")
        for n in ("start", "end", "weight_bytes", "kv_bytes", "runtime_reserve_bytes", "os_reserve_bytes",
                  "total_bytes", "ram_free_bytes"):
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
    def process_bytes(self) -> int:
        """The worker process's predicted peak (anonymous memory): weights + KV + runtime reserve."""
        return self.weight_bytes + self.kv_bytes + self.runtime_reserve_bytes

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


StageSpec = tuple[str, str, int, int]  # (peer_id, device, start, end)


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
    kv: int  # KV cache for context x streams over its layers
    runtime: int  # the worker's own memory (runtime_reserve)
    os: int  # left to the peer's OS and owner

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.runtime + self.os


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

    def weights(self, s: int, e: int, first: bool, last: bool) -> int:
        return self.W[e] - self.W[s] + (self.emb if first else 0) + (self.head if last else self.tail)

    def memory(self, peer_id: str, device: str, s: int, e: int, first: bool, last: bool) -> StageMemory:
        """Memory of a stage over [s, e) on this peer's device."""
        w = self.weights(s, e, first, last)
        rt = self.fixed(peer_id, device) + math.ceil(self.request.runtime_reserve_fraction * w)
        return StageMemory(w, self.kv_layer(peer_id, device) * (e - s), rt, self.os(peer_id))

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
                                mem.total <= ram, comp, hop, ms, 1000.0 / ms))
        cycle = sum(st.predicted_ms_per_token for st in stages)
        bott = max(st.predicted_ms_per_token for st in stages)
        r = self.request
        return Plan(self.model.model_id, tuple(stages), self.precision, self.context,
                    r.streams, bott, cycle, 1000.0 / cycle,
                    min(r.streams * 1000.0 / cycle, 1000.0 / bott), all(st.fits for st in stages),
                    r.exact)


# ---------------------------------------------------------------- search
class _Search:
    """Exact min-bottleneck DP over layer boundaries for every peer order."""

    def __init__(self, fleet: _Fleet, devices: Mapping[str, str]) -> None:
        self.f, self.dev = fleet, devices
        ids = sorted(devices)
        self.bw = {p: fleet.bw(p, devices[p]) for p in ids}
        self.exhaustive = len(ids) <= MAX_EXHAUSTIVE_PEERS
        self.ids = ids if self.exhaustive else sorted(
            ids, key=lambda p: (-self.bw[p], -fleet.peers[p].ram_free_bytes, p))
        L = fleet.L
        idx = np.arange(L + 1)
        self.D = fleet.Wf[None, :] - fleet.Wf[:, None]  # D[s, e] = bytes of [s, e)
        self.nl = idx[None, :] - idx[:, None]  # nl[s, e] = e - s
        self._cache: dict = {}

    def _mats(self, p: str, first: bool):
        """Compute-ms matrix, fit mask (non-last), last-stage compute and fit vectors."""
        key = (p, first)
        if key not in self._cache:
            f, bw, ram = self.f, self.bw[p], self.f.peers[p].ram_free_bytes
            frac = f.request.runtime_reserve_fraction
            kvl, base = f.kv_layer(p, self.dev[p]), f.fixed(p, self.dev[p]) + f.os(p)
            emb = f.emb if first else 0

            def fits(w, nl):  # the same sum as _Fleet.memory, for every range at once
                tot = w + kvl * nl + base + np.ceil(frac * w)
                return (nl > 0) & (tot <= ram)

            comp = self.D / bw
            ok = fits(self.D + emb + f.tail, self.nl)
            w_last = self.D[:, -1] + emb + f.head
            comp_last = (self.D[:, -1] + f.head) / bw
            ok_last = fits(w_last, self.nl[:, -1])
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
                if np.isfinite(lo) and lo <= bound[0] * (1 + _REL_TIE):
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
    search = _Search(fleet, devices)
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
    m = min(k for k, b in finite.items() if b <= best * (1 + _REL_TIE))
    limit = max(finite[m], best) * (1 + _REL_TIE)
    return fleet.build(search.cheapest(m, limit))

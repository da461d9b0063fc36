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
Memory of a stage = weights (+ embeddings on stage 0, + head on the last) +
KV (kv bytes/token/layer * context_length * streams * its layers) + margin
(fixed per peer + a fraction of weights + KV); it must fit the peer's
``ram_free_bytes`` (what its owner's sharing policy allows).

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
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

DEVICE_KINDS = ("CPU", "GPU", "NPU")
# Effective decode bandwidth (bytes/s) when a device was never calibrated:
# conservative figures for an AI PC sharing LPDDR5 between CPU, iGPU and NPU.
DEFAULT_BANDWIDTH_BYTES_PER_S = {"CPU": 40e9, "GPU": 60e9, "NPU": 30e9}
# Bytes per weight element for each precision label.
PRECISION_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
RETURN_BYTES = 8  # the last stage sends a token id (+ header) back, not logits
MAX_EXHAUSTIVE_PEERS = 6  # try every peer order up to this many peers
DEFAULT_PREFERENCE = ("GPU", "NPU", "CPU")
_REL_TIE = 1e-6  # bottlenecks within this relative distance are a tie


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
    ram_free_bytes: int  # memory its owner's sharing policy lets a shard use

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and self.peer_id != "", "peer_id must be non-empty")
        _need(isinstance(self.name, str), "peer name must be a string")
        object.__setattr__(self, "devices", tuple(self.devices))
        _need(all(isinstance(d, DeviceProfile) for d in self.devices), "devices must be DeviceProfile")
        names = [d.name for d in self.devices]
        _need(len(set(names)) == len(names), f"peer {self.peer_id}: device names repeat")
        _need(_is_int(self.ram_free_bytes) and self.ram_free_bytes >= 0, "ram_free_bytes must be >= 0")

    def device(self, name: str) -> DeviceProfile | None:
        return next((d for d in self.devices if d.name == name), None)

    def to_dict(self) -> dict:
        return {**asdict(self), "devices": [d.to_dict() for d in self.devices]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerProfile:
        return _from_dict(cls, d, devices=_tuple_of(DeviceProfile.from_dict))


@dataclass(frozen=True)
class PlanModel:
    model_id: str  # shown in messages
    num_layers: int  # transformer blocks L; ranges cover [0, L)
    hidden_size: int  # width of the hidden state
    bytes_per_layer: tuple[int, ...]  # weight bytes of each block at dtype_bytes
    embedding_bytes: int  # token embeddings, held by stage 0
    head_bytes: int  # final norm + LM head, held (and read per token) by the last stage
    kv_bytes_per_token_per_layer: int  # K + V of one token in one layer, at dtype_bytes
    dtype_bytes: float = 2.0  # bytes per element of the profile's weights (fp16 = 2)
    activation_bytes_per_token: int = 0  # hidden state sent per hop; 0 = hidden_size * 4

    def __post_init__(self) -> None:
        _need(isinstance(self.model_id, str), "model_id must be a string")
        _need(_is_int(self.num_layers) and self.num_layers >= 1, "num_layers must be >= 1")
        _need(_is_int(self.hidden_size) and self.hidden_size >= 1, "hidden_size must be >= 1")
        object.__setattr__(self, "bytes_per_layer", tuple(self.bytes_per_layer))
        _need(len(self.bytes_per_layer) == self.num_layers,
              f"bytes_per_layer has {len(self.bytes_per_layer)} entries for {self.num_layers} layers")
        _need(all(_is_int(b) and b > 0 for b in self.bytes_per_layer), "layer bytes must be > 0")
        for n in ("embedding_bytes", "head_bytes", "kv_bytes_per_token_per_layer",
                  "activation_bytes_per_token"):
            _need(_is_int(getattr(self, n)) and getattr(self, n) >= 0, f"{n} must be an int >= 0")
        _need(_is_num(self.dtype_bytes) and self.dtype_bytes > 0, "dtype_bytes must be > 0")
        _floats(self, "dtype_bytes")
        if self.activation_bytes_per_token == 0:
            object.__setattr__(self, "activation_bytes_per_token", self.hidden_size * 4)

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
        kv_tok = g("kv_bytes_per_token")
        if kv_tok:
            kv_layer = -(-int(kv_tok) // n)
        else:
            heads = g("num_kv_heads") or g("num_heads") or 0
            kv_layer = int(2 * heads * (g("head_dim") or 0) * dtype)
        hidden = int(g("hidden_size"))
        return cls(model_id=str(g("model_id", "")), num_layers=n, hidden_size=hidden,
                   bytes_per_layer=per, embedding_bytes=emb, head_bytes=head,
                   kv_bytes_per_token_per_layer=kv_layer, dtype_bytes=dtype,
                   activation_bytes_per_token=hidden * 4)

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_per_layer": list(self.bytes_per_layer)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanModel:
        return _from_dict(cls, d, bytes_per_layer=_tuple_of(lambda x: x))


@dataclass(frozen=True)
class PlanRequest:
    context_length: int = 4096  # tokens of KV reserved per stream
    streams: int = 1  # concurrent streams; each keeps its own KV on every stage
    kv_dtype_bytes: float | None = None  # bytes per KV element; None = model dtype
    runtime_margin_bytes: int = 500_000_000  # fixed headroom per used peer
    runtime_margin_fraction: float = 0.05  # + this fraction of the peer's weights + KV
    weight_precision: str = "native"  # "native" (profile dtype) or a PRECISION_BYTES key

    def __post_init__(self) -> None:
        _need(_is_int(self.context_length) and self.context_length >= 1, "context_length must be >= 1")
        _need(_is_int(self.streams) and self.streams >= 1, "streams must be >= 1")
        _need(self.kv_dtype_bytes is None or (_is_num(self.kv_dtype_bytes) and self.kv_dtype_bytes > 0),
              "kv_dtype_bytes must be > 0 or null")
        _need(_is_int(self.runtime_margin_bytes) and self.runtime_margin_bytes >= 0,
              "runtime_margin_bytes must be >= 0")
        _need(_is_num(self.runtime_margin_fraction) and 0 <= self.runtime_margin_fraction < 1,
              "runtime_margin_fraction must be in [0, 1)")
        _need(self.weight_precision == "native" or self.weight_precision in PRECISION_BYTES,
              f"weight_precision must be native or one of {', '.join(PRECISION_BYTES)}")
        _floats(self, "kv_dtype_bytes", "runtime_margin_fraction")

    def weight_factor(self, dtype_bytes: float) -> float:
        """Weight bytes at this precision / at the profile's dtype (int4 on fp16 = 0.25)."""
        if self.weight_precision == "native":
            return 1.0
        return PRECISION_BYTES[self.weight_precision] / dtype_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanRequest:
        return _from_dict(cls, d)


# ---------------------------------------------------------------- outputs
@dataclass(frozen=True)
class PlanIssue:
    stage: int | None  # index of the stage it concerns; None = the whole plan
    code: str  # machine tag: empty_plan, empty_range, out_of_range, gap, overlap, ...
    message: str  # one precise sentence for the user

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Stage:
    peer_id: str  # peer that runs it
    device: str  # device name on that peer ("GPU.0")
    start: int  # first layer (inclusive)
    end: int  # last layer + 1 (exclusive)
    weight_bytes: int  # its layers (+ embeddings if first, + head if last) at the precision
    kv_bytes: int  # KV for context_length * streams tokens over its layers
    margin_bytes: int  # runtime headroom reserved on the peer
    total_bytes: int  # weight + kv + margin
    ram_free_bytes: int  # what the peer shares
    fits: bool  # total_bytes <= ram_free_bytes
    compute_ms: float  # predicted compute per token
    hop_ms: float  # predicted outgoing transfer per token
    predicted_ms_per_token: float  # compute + hop
    predicted_tok_s: float  # 1000 / predicted_ms_per_token: the stage's own cap

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and isinstance(self.device, str), "bad stage peer/device")
        for n in ("start", "end", "weight_bytes", "kv_bytes", "margin_bytes", "total_bytes",
                  "ram_free_bytes"):
            _need(_is_int(getattr(self, n)), f"stage {n} must be an int")
        _need(isinstance(self.fits, bool), "stage fits must be a bool")
        for n in ("compute_ms", "hop_ms", "predicted_ms_per_token", "predicted_tok_s"):
            _need(_is_num(getattr(self, n)), f"stage {n} must be a number")
        _floats(self, "compute_ms", "hop_ms", "predicted_ms_per_token", "predicted_tok_s")

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class Plan:
    model_id: str  # the model it partitions
    stages: tuple[Stage, ...]  # in ring order; stage 0 holds embeddings, the last the head
    weight_precision: str  # precision the bytes were computed at
    context_length: int  # tokens of KV reserved per stream
    streams: int  # concurrent streams the KV was sized for
    bottleneck_ms: float  # max stage time per token
    cycle_ms: float  # sum of stage times: one token of one stream around the ring
    predicted_tok_s: float  # single stream: 1000 / cycle_ms
    predicted_aggregate_tok_s: float  # min(streams * 1000 / cycle, 1000 / bottleneck)
    fits: bool  # every stage fits its peer

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        _need(all(isinstance(s, Stage) for s in self.stages), "plan stages must be Stage")
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
class _Fleet:
    """The numbers behind every cost: scaled bytes, bandwidths, links."""

    def __init__(self, model: PlanModel, peers: Sequence[PeerProfile], request: PlanRequest,
                 links: Links | None = None) -> None:
        self.model, self.request, self.links = model, request, links or {}
        self.peers: dict[str, PeerProfile] = {}
        for p in peers:
            if p.peer_id in self.peers:
                raise PlanError(f"peer id {p.peer_id} appears twice in the fleet")
            self.peers[p.peer_id] = p
        f = request.weight_factor(model.dtype_bytes)
        self.W = [0]  # W[i] = scaled weight bytes of layers [0, i)
        for b in model.bytes_per_layer:
            self.W.append(self.W[-1] + math.ceil(b * f))
        self.Wf = np.array(self.W, dtype=np.float64)
        self.emb = math.ceil(model.embedding_bytes * f)
        self.head = math.ceil(model.head_bytes * f)
        kv_el = request.kv_dtype_bytes or model.dtype_bytes
        kv_tok = math.ceil(model.kv_bytes_per_token_per_layer * kv_el / model.dtype_bytes)
        self.kv_layer = kv_tok * request.context_length * request.streams  # per layer
        self.L = model.num_layers
        self.mean_layer = self.W[-1] / self.L

    def margin(self, w: float, kv: float) -> int:
        r = self.request
        return r.runtime_margin_bytes + math.ceil(r.runtime_margin_fraction * (w + kv))

    def memory(self, s: int, e: int, first: bool, last: bool) -> tuple[int, int, int, int]:
        """(weights, kv, margin, total) of a stage over [s, e)."""
        w = self.W[e] - self.W[s] + (self.emb if first else 0) + (self.head if last else 0)
        kv = self.kv_layer * (e - s)
        m = self.margin(w, kv)
        return w, kv, m, w + kv + m

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
            w, kv, m, tot = self.memory(s, e, first, last)
            comp = self.compute_ms(self.bw(pid, dev), s, e, last)
            hop = self.hop_ms(pid, specs[0][0] if last else specs[i + 1][0], last)
            ms = comp + hop
            ram = self.peers[pid].ram_free_bytes
            stages.append(Stage(pid, dev, s, e, w, kv, m, tot, ram, tot <= ram,
                                comp, hop, ms, 1000.0 / ms))
        cycle = sum(st.predicted_ms_per_token for st in stages)
        bott = max(st.predicted_ms_per_token for st in stages)
        r = self.request
        return Plan(self.model.model_id, tuple(stages), r.weight_precision, r.context_length,
                    r.streams, bott, cycle, 1000.0 / cycle,
                    min(r.streams * 1000.0 / cycle, 1000.0 / bott), all(st.fits for st in stages))


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
            r = f.request
            emb = f.emb if first else 0

            def fits(w, nl):
                kv = f.kv_layer * nl
                tot = w + kv + r.runtime_margin_bytes + np.ceil(r.runtime_margin_fraction * (w + kv))
                return (nl > 0) & (tot <= ram)

            comp = self.D / bw
            ok = fits(self.D + emb, self.nl)
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
    (ties: earlier kind) unless pinned_devices names one. Raises PlanError with
    the needed and available memory when nothing fits.
    """
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
        from engine.pipeline.plan_validate import explain_infeasible

        raise PlanError(explain_infeasible(fleet, sorted(devices), device_preference))
    best = min(finite.values())
    m = min(k for k, b in finite.items() if b <= best * (1 + _REL_TIE))
    limit = max(finite[m], best) * (1 + _REL_TIE)
    return fleet.build(search.cheapest(m, limit))

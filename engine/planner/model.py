"""PlanModel: what the planner knows of a model (layers, bytes, parameter counts, KV shape)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from engine.planner.json_form import _from_dict, _tuple_of
from engine.planner.memory import (
    DEFAULT_HEAD_DIM, PRECISION_BYTES, PRECISIONS, WeightCounts, _floats, _is_int, _is_num, _need, weight_bytes_of)


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
    # Empty: a dense model. The CPU runtime holds these twice (planner.memory.EXPERT_COPIES).
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

"""Model profiles: the numbers planners need, read without loading weights.

Sizes come from the safetensors headers (shape x dtype of every tensor, i.e.
the bytes really stored), grouped by decoder layer. When there are no headers
(OpenVINO IR, pytorch_model.bin) they are computed from config.json and then
scaled so that they add up to the real size of the weight files: a compressed
(int8/int4) IR is smaller than its config suggests, and a planner must see the
bytes a peer will actually hold.

Besides bytes (at the checkpoint's dtype), a profile counts parameters by how
weight compression treats them (ParamCounts: matrices, their output rows,
1-D vectors), per layer, for the embedding, the head and a layer's last
MatMul, so the planner can size a shard at any precision (f32 ... int4) the
way the exporter writes it. KV is counted in elements (kv_elements_per_token);
the planner applies the element size the runtime really uses.

Tied embeddings: when the LM head shares the embedding matrix, head_bytes
still counts that matrix. A pipeline puts the embedding on the first stage and
the head on the last one, usually different peers, and each shard then holds
its own copy (the OpenVINO shard export duplicates it). So
    embedding_bytes + sum(bytes_per_layer) + head_bytes
          == total_bytes + (embedding matrix if tied_embeddings)
and total_bytes stays the bytes on disk, what a single-node runtime needs.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from engine.models.config_file import read_config, text_config, try_text_config
from engine.models.errors import ModelError
from engine.models.ref import ResolvedModel, architecture_of, read_safetensors_header, safetensors_files

PROFILE_VERSION = 2  # 2: dtype label and parameter counts (ParamCounts)

# Tokens of context a plan reserves KV for when the user names none: what a
# chat user picks (a few pages of conversation), clipped to the model's own
# maximum by default_context(); never the 128k maximum of a Llama 3.1, whose
# KV alone (16 GB at f16 for 8B) would not fit the PCs this runs on. Also the
# max_context of a config that names none. engine/scheduler/loop.py should use it.
DEFAULT_CONTEXT = 4096

# `model.layers.3.` (Llama family), `transformer.h.3.` (GPT-2), `...blocks.3.`.
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
# Per-expert tensors `mlp.experts.5.up_proj.weight` (Qwen-MoE, Mixtral's
# block_sparse_moe.experts.5.w1, OLMoE) versus the stacked layout of
# transformers 5 in memory: `mlp.experts.gate_up_proj` of shape [E, 2I, H].
_EXPERT_ONE = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_STACKED = re.compile(r"\.experts\.[A-Za-z_]+(?:\.weight|\.bias)?$")
_EMBED_KEYS = ("embed_tokens", "wte", "wpe", "word_embeddings", "embed_positions", "embed_in")
_HEAD_MATRIX = ("lm_head.", "embed_out.")

_DTYPE_NAMES = {"float32": 4, "float": 4, "float64": 8, "double": 8, "bfloat16": 2,
                "float16": 2, "half": 2}
# The team's weight precision labels of checkpoint dtypes (config names / safetensors names).
_DTYPE_LABELS = {"float32": "f32", "float": "f32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                 "F32": "f32", "BF16": "bf16", "F16": "fp16"}
# A layer's last MatMul (NNCF keeps the last MatMul of an int4 graph in int8, which for a
# shard that does not end with the LM head is its last layer's down projection).
_TAIL = re.compile(r"(?:down_proj|\.w2|fc2|dense_4h_to_h|mlp\.c_proj)\.weight$")


def default_context(max_context: int) -> int:
    """The context a plan uses unless the user picks one: DEFAULT_CONTEXT, at most the model's."""
    return min(DEFAULT_CONTEXT, max_context) if max_context and max_context > 0 else DEFAULT_CONTEXT


_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def trained_context(model_dir: Path | str) -> int:
    """The model's trained context length from its config.json (DEFAULT_CONTEXT if it names none)."""
    v = _first(try_text_config(model_dir), *_CONTEXT_KEYS)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else DEFAULT_CONTEXT


def engine_context(model_dir: Path | str, asked: int | None = None) -> int:
    """The context (prompt + answer tokens) every engine and the planner serve a model with:
    what was asked, at most the model's trained maximum; when nothing was asked,
    default_context (DEFAULT_CONTEXT, at most the maximum), never the model's 128k maximum.
    The one copy of this rule."""
    trained = trained_context(model_dir)
    return min(asked, trained) if asked else default_context(trained)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of some weight tensors, grouped by how weight compression treats them."""

    matrix: int = 0  # elements of 2-D+ tensors (Linear weights, embedding tables): int8/int4 compress these
    rows: int = 0  # output channels of those (int8 stores one scale + zero point per row)
    vector: int = 0  # elements of 1-D tensors (norm weights, biases): the IR keeps them f32

    def __add__(self, other: ParamCounts) -> ParamCounts:
        return ParamCounts(self.matrix + other.matrix, self.rows + other.rows, self.vector + other.vector)

    @classmethod
    def of_shape(cls, shape: list[int] | tuple[int, ...]) -> ParamCounts:
        """One tensor: [out, in] (or stacked [E, out, in]) is a matrix with E * out rows."""
        n = 1
        for d in shape:
            n *= int(d)
        if len(shape) >= 2:
            return cls(matrix=n, rows=n // max(1, int(shape[-1])))
        return cls(vector=n)


@dataclass(frozen=True)
class ExpertInfo:
    """Mixture-of-experts layout (per MoE layer; all MoE layers are alike)."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    bytes_per_expert: int  # one routed expert of one layer (gate + up + down)
    shared_expert_bytes: int  # always-on shared expert(s) + their gate, per MoE layer; 0 if none
    moe_layers: tuple[int, ...]  # indices of decoder layers that have experts


@dataclass(frozen=True)
class ModelProfile:
    """Shape and size of a causal LM, as planners and the UI need them."""

    model_id: str  # display name from ResolvedModel
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # config model_type, e.g. "llama"
    num_layers: int  # decoder layers
    hidden_size: int  # residual stream width
    intermediate_size: int  # dense FFN width (MoE models: the config value, may be unused)
    num_heads: int  # attention (query) heads
    num_kv_heads: int  # key/value heads (GQA); == num_heads for MHA
    head_dim: int  # per-head width
    vocab_size: int  # tokenizer / embedding rows
    dtype_bytes: int  # bytes per weight element from config dtype (4 f32, 2 bf16/f16)
    bytes_per_layer: tuple[int, ...]  # stored weight bytes of each decoder layer
    embedding_bytes: int  # token (and position) embeddings
    head_bytes: int  # lm_head + final norm (+ the embedding matrix again if tied)
    total_bytes: int  # all weight bytes on disk (shared matrices once)
    max_context: int  # max_position_embeddings (or equivalent); DEFAULT_CONTEXT if the config names none
    tied_embeddings: bool = False  # lm_head shares the embedding matrix
    experts: ExpertInfo | None = None  # None for dense models
    dtype: str = "f32"  # the checkpoint's weight dtype as a precision label: "f32" | "bf16" | "fp16"
    layer_params: tuple[ParamCounts, ...] = ()  # parameters of each decoder layer
    embedding_params: ParamCounts = ParamCounts()  # token (and position) embedding tables
    head_params: ParamCounts = ParamCounts()  # LM head matrix (the embedding again if tied) + final norm
    layer_tail_params: ParamCounts = ParamCounts()  # a layer's last MatMul (its down projection)

    @property
    def kv_elements_per_token(self) -> int:
        """K + V elements one token keeps over all layers; bytes = this x the runtime's
        element size (engine.planner.plan.kv_element_bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """The same at f32 width (4 bytes), for displays; planners use kv_elements_per_token."""
        return 4 * self.kv_elements_per_token

    def kv_bytes(self, tokens: int, dtype_bytes: float = 4) -> int:
        """KV cache bytes for `tokens` tokens with `dtype_bytes` per element."""
        return int(int(tokens) * self.kv_elements_per_token * dtype_bytes)

    def layer_range_bytes(self, start: int, end: int) -> int:
        """Weight bytes of the half-open layer range [start, end)."""
        return sum(self.bytes_per_layer[start:end])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples become lists)."""
        d = asdict(self)
        d["bytes_per_layer"] = list(self.bytes_per_layer)
        d["layer_params"] = [asdict(c) for c in self.layer_params]
        if self.experts is not None:
            d["experts"]["moe_layers"] = list(self.experts.moe_layers)
        d["version"] = PROFILE_VERSION
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        """Inverse of to_dict; unknown keys are ignored, missing ones rejected."""
        if not isinstance(data, dict):
            raise ModelError("malformed model profile: expected a JSON object")
        if data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise ModelError(f"model profile version {data.get('version')} is not supported "
                             f"(expected {PROFILE_VERSION}); re-profile the model")
        try:
            kw = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
            if missing:
                raise ModelError(f"malformed model profile: missing {', '.join(missing)}")
            kw["bytes_per_layer"] = tuple(int(b) for b in kw["bytes_per_layer"])
            if "layer_params" in kw:
                kw["layer_params"] = tuple(_counts(c) for c in kw["layer_params"])
            for name in ("embedding_params", "head_params", "layer_tail_params"):
                if name in kw:
                    kw[name] = _counts(kw[name])
            exp = kw.get("experts")
            if exp is not None:
                kw["experts"] = ExpertInfo(
                    num_experts=int(exp["num_experts"]), top_k=int(exp["top_k"]),
                    bytes_per_expert=int(exp["bytes_per_expert"]),
                    shared_expert_bytes=int(exp["shared_expert_bytes"]),
                    moe_layers=tuple(int(i) for i in exp["moe_layers"]))
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"malformed model profile: bad field ({e})") from None


def _counts(c: Any) -> ParamCounts:
    return ParamCounts(int(c["matrix"]), int(c["rows"]), int(c["vector"]))


def profile_model(resolved: ResolvedModel | str | Path) -> ModelProfile:
    """Profile a model from its config and weight headers, never the weights.

    `resolved` is a ResolvedModel, or a folder path: then any folder with a
    config.json works, weights and tokenizer optional (a config-only folder is
    sized from the config at its dtype, e.g. to plan a 70B model before
    downloading it)."""
    if not isinstance(resolved, ResolvedModel):
        resolved = _bare_folder(Path(resolved))
    raw = read_config(resolved.path)
    config = text_config(raw)
    shape = _shape(config)
    L = shape["num_layers"]
    files = safetensors_files(resolved.path) if resolved.weights_format == "safetensors" else []
    if files:
        parts = _from_headers(files, L)
    else:
        parts = _from_config(config, shape, _weights_size(resolved))
    per_layer, embed, head, embed_matrix, total, tied, expert, counts = parts
    if tied:
        head += embed_matrix
    experts = _experts(config, L, expert)
    return ModelProfile(
        model_id=resolved.model_id, architecture=resolved.architecture,
        model_type=str(config.get("model_type") or "unknown"),
        dtype_bytes=_dtype_bytes(config), bytes_per_layer=tuple(per_layer),
        embedding_bytes=embed, head_bytes=head, total_bytes=total,
        tied_embeddings=tied, experts=experts,
        max_context=int(_first(config, *_CONTEXT_KEYS) or DEFAULT_CONTEXT),
        dtype=counts["dtype"] or _dtype_label(config), layer_params=tuple(counts["layers"]),
        embedding_params=counts["embedding"], head_params=counts["head"],
        layer_tail_params=counts["tail"], **shape)


def _bare_folder(path: Path) -> ResolvedModel:
    """A ResolvedModel for a folder that need only hold config.json."""
    config = read_config(path)
    fmt = ("openvino" if (path / "openvino_model.xml").is_file()
           else "safetensors" if safetensors_files(path) else "pytorch")
    return ResolvedModel(spec=str(path), model_id=path.name or str(path), path=path, kind="hf",
                         architecture=architecture_of(config), fingerprint="", weights_format=fmt)


# --------------------------------------------------------------------------- config

def _first(config: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def _shape(config: dict[str, Any]) -> dict[str, int]:
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        raise ModelError("config.json lacks num_hidden_layers / hidden_size / num_attention_heads; "
                         "cannot profile this model")
    kv = _first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is None:
        kv = 1 if config.get("multi_query") else heads
    return dict(
        num_layers=int(layers), hidden_size=int(hidden),
        intermediate_size=int(_first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden),
        num_heads=int(heads), num_kv_heads=int(kv),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab_size=int(config.get("vocab_size") or 0),
    )


def _dtype_bytes(config: dict[str, Any]) -> int:
    name = _first(config, "dtype", "torch_dtype")
    return _DTYPE_NAMES.get(str(name).replace("torch.", ""), 4) if name else 4


def _dtype_label(config: dict[str, Any]) -> str:
    name = _first(config, "dtype", "torch_dtype")
    return _DTYPE_LABELS.get(str(name).replace("torch.", ""), "f32") if name else "f32"


# --------------------------------------------------------------------------- headers

def _from_headers(files: list[Path], num_layers: int):
    per_layer = [0] * num_layers
    embed = head = embed_matrix = total = 0
    has_head_matrix = False
    expert: dict[int, dict[str, Any]] = {}  # layer -> counters, see _count_expert
    layers = [ParamCounts()] * num_layers
    emb_c = head_c = matrix_c = ParamCounts()
    tails: list[tuple[bool, int, ParamCounts]] = []  # (not an expert, elements, counts) per layer tail
    dtypes: dict[str, int] = {}  # dtype label -> bytes
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            nbytes = int(end) - int(begin)
            total += nbytes
            label = _DTYPE_LABELS.get(str(info.get("dtype")))
            if label:
                dtypes[label] = dtypes.get(label, 0) + nbytes
            c = ParamCounts.of_shape(info.get("shape") or [])
            m = _LAYER.search(name)
            if m and int(m.group(1)) < num_layers:
                i = int(m.group(1))
                per_layer[i] += nbytes
                layers[i] = layers[i] + c
                _count_expert(expert.setdefault(i, {}), name[m.end():], info, nbytes)
                if i == 0 and _TAIL.search(name) and c.matrix:
                    one = _one_expert(c, info) if ".experts" in name else c
                    tails.append((".experts" not in name, one.matrix, one))
            elif any(k in name for k in _EMBED_KEYS):
                embed += nbytes
                emb_c = emb_c + c
                if "embed_tokens" in name or "wte" in name or "word_embeddings" in name or "embed_in" in name:
                    embed_matrix += nbytes
                    matrix_c = matrix_c + c
            else:
                # lm_head, final norm, and anything else outside the layers
                # (e.g. multi-token-prediction heads) sits with the head.
                head += nbytes
                head_c = head_c + c
                has_head_matrix |= name.startswith(_HEAD_MATRIX) or ".lm_head." in name
    tied = not has_head_matrix
    counts = {"layers": layers, "embedding": emb_c, "head": head_c + (matrix_c if tied else ParamCounts()),
              "tail": max(tails, key=lambda t: (t[0], t[1]))[2] if tails else ParamCounts(),
              "dtype": max(dtypes, key=lambda k: (dtypes[k], k)) if dtypes else ""}
    return per_layer, embed, head, embed_matrix, total, tied, expert, counts


def _one_expert(c: ParamCounts, info: dict[str, Any]) -> ParamCounts:
    """One expert's share of a stacked [E, out, in] tensor (a per-expert tensor is one already)."""
    shape = info.get("shape") or []
    n = int(shape[0]) if len(shape) == 3 else 1
    return ParamCounts(c.matrix // n, c.rows // n, c.vector // n)


def _count_expert(acc: dict[str, Any], suffix: str, info: dict[str, Any], nbytes: int) -> None:
    """Accumulate the MoE tensors of one layer (suffix = name after `layers.i.`)."""
    one = _EXPERT_ONE.search("." + suffix)
    if one:
        e = int(one.group(1))
        acc.setdefault("per_expert", {}).setdefault(e, 0)
        acc["per_expert"][e] += nbytes
    elif _EXPERT_STACKED.search("." + suffix) and info.get("shape"):
        # Stacked [E, ...]: one expert's share is nbytes / E.
        n = int(info["shape"][0])
        acc["stacked"] = acc.get("stacked", 0) + nbytes // max(n, 1)
        acc["stacked_n"] = n
    elif "shared_expert" in suffix:
        acc["shared"] = acc.get("shared", 0) + nbytes


def _experts(config: dict[str, Any], num_layers: int, counted: dict[int, dict[str, Any]]) -> ExpertInfo | None:
    n = _first(config, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _first(config, "num_experts_per_tok", "moe_topk", "top_k")
    if not n or not top_k:
        return None
    moe_layers = sorted(i for i, c in counted.items() if c.get("per_expert") or c.get("stacked"))
    if moe_layers:
        c = counted[moe_layers[0]]
        per = c.get("per_expert")
        bytes_per_expert = max(per.values()) if per else int(c["stacked"])
        shared = int(c.get("shared", 0))
    else:  # no headers: the config-based estimate left its numbers here
        est = counted.get(-1, {})
        moe_layers = _config_moe_layers(config, num_layers)
        bytes_per_expert = int(est.get("expert", 0))
        shared = int(est.get("shared", 0))
    return ExpertInfo(num_experts=int(n), top_k=int(top_k), bytes_per_expert=bytes_per_expert,
                      shared_expert_bytes=shared, moe_layers=tuple(moe_layers))


def _config_moe_layers(config: dict[str, Any], num_layers: int) -> list[int]:
    """Which layers are sparse, by the rules of each family's config."""
    if not _first(config, "num_experts", "num_local_experts", "n_routed_experts"):
        return []
    if "first_k_dense_replace" in config:  # DeepSeek
        freq = int(config.get("moe_layer_freq") or 1)
        k = int(config["first_k_dense_replace"] or 0)
        return [i for i in range(num_layers) if i >= k and i % freq == 0]
    step = int(config.get("decoder_sparse_step") or 1)  # Qwen2/3-MoE; Mixtral/OLMoE: all
    dense = set(config.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


# --------------------------------------------------------------------------- config estimate

def _weights_size(resolved: ResolvedModel) -> int:
    path = resolved.path
    if resolved.weights_format == "openvino":
        files = [path / "openvino_model.bin"]
    else:
        files = sorted(path.glob("pytorch_model*.bin"))
    return sum(f.stat().st_size for f in files if f.is_file())


def _from_config(config: dict[str, Any], s: dict[str, int], actual_total: int):
    """Parameter counts of a Llama/Qwen/Mixtral-style decoder, in bytes.

    Approximate for other families; scaled to the real weight-file size so
    compressed IRs are not overestimated.
    """
    H, I, hd, V = s["hidden_size"], s["intermediate_size"], s["head_dim"], s["vocab_size"]
    q, kv = s["num_heads"] * hd, s["num_kv_heads"] * hd
    mt = str(config.get("model_type") or "")
    bias = bool(config.get("attention_bias") or config.get("qkv_bias")) or mt in ("qwen2", "qwen2_moe")
    P = ParamCounts  # noqa: N806

    def linear(out: int, inp: int, n: int = 1) -> ParamCounts:  # n Linear layers [out, inp]
        return P(matrix=n * out * inp, rows=n * out)

    # q, k, v, o projections (+ q/k/v biases), the two norms (+ Qwen3's q/k norms).
    attn = linear(q, H) + linear(kv, H, 2) + linear(H, q) + P(vector=(q + 2 * kv) if bias else 0)
    norms = P(vector=2 * H + (2 * hd if mt.startswith("qwen3") else 0))
    dense_mlp = linear(I, H, 2) + linear(H, I)  # gate, up, down
    moe = set(_config_moe_layers(config, s["num_layers"]))
    n_exp = int(_first(config, "num_experts", "num_local_experts", "n_routed_experts") or 0)
    im = int(_first(config, "moe_intermediate_size") or I)
    expert = linear(im, H, 2) + linear(H, im)
    shared_i = int(config.get("shared_expert_intermediate_size") or 0)
    shared = (linear(shared_i, H, 2) + linear(H, shared_i) + linear(1, H)) if shared_i else P()
    router = linear(n_exp, H)
    moe_mlp = router + P(n_exp * expert.matrix, n_exp * expert.rows, n_exp * expert.vector) + shared
    counts = [attn + norms + (moe_mlp if i in moe else dense_mlp) for i in range(s["num_layers"])]
    embed = linear(V, H)
    tied = bool(config.get("tie_word_embeddings", False))
    head = linear(V, H) + P(vector=H)  # the matrix again when tied: the last stage holds its own
    layers = [c.matrix + c.vector for c in counts]
    head_n = H + (0 if tied else V * H)
    params = sum(layers) + embed.matrix + head_n
    # Bytes per parameter: the real file size when known, else the config dtype.
    scale = actual_total / params if actual_total else float(_dtype_bytes(config))
    b = lambda x: int(round(x * scale))  # noqa: E731
    total = actual_total or b(params)
    est = {-1: {"expert": b(expert.matrix), "shared": b(shared.matrix + shared.vector)}}
    tail = linear(H, im) if 0 in moe and not shared_i else linear(H, shared_i if 0 in moe else I)
    meta = {"layers": counts, "embedding": embed, "head": head, "tail": tail, "dtype": ""}
    return [b(x) for x in layers], b(embed.matrix), b(head_n), b(embed.matrix), total, tied, est, meta


__all__ = ["DEFAULT_CONTEXT", "ExpertInfo", "ModelProfile", "ParamCounts", "PROFILE_VERSION",
           "default_context", "profile_model"]

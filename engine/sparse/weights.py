"""Which tensors are FFN neurons, a model skeleton without them, and
safetensors weights mapped (not copied) from disk.

The sparse engine and the baselines build the transformers model with
intermediate_size = 1, so the FFN weights are never allocated; then they put
the real weights in: attention, norms and embeddings as resident copies (ours)
or as mmap-backed tensors (the OS-paging baseline), and the FFNs as our
SparseMLP or as mmap-backed dense Linear weights.

Supported FFNs: the gated family (Llama, Mistral, Qwen2/3, ...: down(act(gate x) * up x))
without biases, any activation (silu = SwiGLU, relu = "ReLU-fied" Llama).
"""

from __future__ import annotations

import copy
import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.models.config_file import read_text_config
from engine.models.errors import ModelError

RELU_FAMILY = ("relu", "relu2", "relu6")  # activations with natural zeros

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}  # BF16: raw words


@dataclass(frozen=True)
class FFNLayout:
    """The FFN shape of a gated-MLP decoder model."""

    num_layers: int  # decoder layers, each with one FFN
    hidden: int  # model width h
    neurons: int  # intermediate size N: neurons per FFN layer
    act: str  # config hidden_act: "silu", "relu", ...
    prefix: str  # "model.layers" : where the decoder layers live in the state dict

    @property
    def relu_family(self) -> bool:
        return self.act in RELU_FAMILY

    def key(self, layer: int, part: str) -> str:
        """State-dict key of one FFN matrix: part is gate / up / down."""
        return f"{self.prefix}.{layer}.mlp.{part}_proj.weight"

    def is_ffn_key(self, key: str) -> bool:
        return ".mlp." in key and key.startswith(self.prefix + ".") and key.endswith("_proj.weight")


def ffn_layout(model_dir: Path) -> FFNLayout:
    """The FFN layout of a model folder; refuses architectures the engine cannot split."""
    cfg = read_text_config(model_dir)
    names = tensor_names(model_dir)
    layout = FFNLayout(num_layers=int(cfg["num_hidden_layers"]), hidden=int(cfg["hidden_size"]),
                       neurons=int(cfg["intermediate_size"]), act=str(cfg.get("hidden_act", "silu")),
                       prefix="model.layers")
    for part in ("gate", "up", "down"):
        if layout.key(0, part) not in names:
            raise ModelError(f"{model_dir} has no {layout.key(0, part)}: the sparse engine needs a gated "
                             "MLP (Llama, Mistral, Qwen2/3 style); MoE and OPT-style FFNs are not supported")
    if any(k.endswith("mlp.gate_proj.bias") for k in names):
        raise ModelError("FFNs with biases are not supported by the sparse engine")
    return layout


# --------------------------------------------------------------------------- safetensors via mmap

def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (engine.models.ref: every shard of an index present)."""
    from engine.models.ref import safetensors_files as files_of

    files = files_of(Path(model_dir))
    if not files:
        raise ModelError(f"{model_dir} has no safetensors weights (the sparse engine reads safetensors)")
    return files


def _header(file: Path) -> tuple[dict, int]:
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head, 8 + n


def tensor_names(model_dir: Path) -> set[str]:
    return {k for f in safetensors_files(model_dir) for k in _header(f)[0]}


class MappedWeights:
    """Every tensor of a model folder as a read-only view of an mmap of its file.

    Nothing is read until a tensor is touched; the OS pages weights in on use
    and may drop them again under memory pressure (that is the mmap baseline)."""

    def __init__(self, model_dir: Path) -> None:
        self._maps: list[mmap.mmap] = []
        self._where: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        for i, file in enumerate(safetensors_files(model_dir)):
            head, base = _header(file)
            with open(file, "rb") as f:
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            for name, info in head.items():
                start, end = info["data_offsets"]
                self._where[name] = (i, base + start, info["dtype"], tuple(info["shape"]))
        self.files = safetensors_files(model_dir)

    def names(self) -> list[str]:
        return list(self._where)

    def dtype_of(self, name: str) -> str:
        return self._where[name][2]

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (BF16 as uint16 words), a view of the mmap."""
        i, off, dt, shape = self._where[name]
        if _ST_DTYPES.get(dt) is None:
            raise ModelError(f"tensor {name} has dtype {dt}; the sparse engine reads F32/F16/BF16 weights")
        dtype = np.dtype(_ST_DTYPES[dt])
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(self._maps[i], dtype=dtype, count=count, offset=off).reshape(shape)

    def numpy(self, name: str) -> np.ndarray:
        if self.dtype_of(name) == "BF16":
            raise ModelError(f"tensor {name} is BF16, which numpy cannot hold; use .torch()")
        return self.raw(name)

    def torch(self, name: str):
        return _as_torch(self.raw(name), self.dtype_of(name))

    def detached(self, name: str):
        """The tensor as a view of a mapping of its own bytes only (runtime.stored.mapped_tensor):
        unlike a view into the shared maps, it does not keep every page the resident copies
        touched mapped (and counted as used) for as long as it lives."""
        from engine.runtime.stored import mapped_tensor

        i, off, dt, shape = self._where[name]
        return mapped_tensor(self.files[i], off, shape, dt)


def _as_torch(a: np.ndarray, st_dtype: str):
    import torch

    with warnings.catch_warnings():  # read-only buffer: we never write into it
        warnings.simplefilter("ignore")
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if st_dtype == "BF16" else t


# --------------------------------------------------------------------------- skeleton

def build_skeleton(model_dir: Path):
    """The transformers model with 1-neuron FFNs, on the meta device: no weight is
    allocated until put_weights puts the checkpoint's own tensors in."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    small = copy.deepcopy(config)
    target = getattr(small, "text_config", small)
    target.intermediate_size = 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    model.config = config  # what users and the generation code see is the real config
    return model.eval()


def _finish_skeleton(model) -> None:
    """RoPE tables are non-persistent buffers (never in a checkpoint): rebuild them on the
    CPU; then no parameter or buffer may still be on the meta device, except the FFNs the
    engine replaces with its own modules."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    rope = getattr(base, "rotary_emb", None)
    if rope is not None:
        base.rotary_emb = type(rope)(config=getattr(model.config, "text_config", model.config))
    for layer in getattr(base, "layers", []):  # older layouts keep a rotary module per attention
        attn = getattr(layer, "self_attn", None)
        if attn is not None and getattr(attn, "rotary_emb", None) is not None:
            attn.rotary_emb = type(attn.rotary_emb)(config=getattr(model.config, "text_config", model.config))


def put_weights(model, weights: MappedWeights, layout: FFNLayout, resident: bool, with_ffn: bool,
                copy_rest: bool = True) -> int:
    """Put the file's weights into the meta-device skeleton. Non-FFN weights (attention,
    norms, embeddings) are resident copies (copy_rest) or views of the mmap (calibration,
    which pages each layer in once); FFN matrices (only when with_ffn) are copies when
    `resident`, else views of the mmap (the OS-paging baseline). 16-bit Linear weights
    and embeddings stay in their dtype (Linear computes with mixed_linear, as llama.cpp
    does and as the sparse engine's FFN does; embedding rows are widened on lookup);
    16-bit norms become f32 (a few KB). An untied input embedding is always a view of
    the mmap (a lookup reads only its rows). Returns the RAM bytes of the copied non-FFN
    weights."""
    import types

    import torch

    non_ffn = 0
    names = set(weights.names())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, _ in list(model.named_parameters()):
        ffn = layout.is_ffn_key(name)
        if ffn and not with_ffn:
            continue
        src = name
        if src not in names and name == "lm_head.weight":
            src = "model.embed_tokens.weight"  # tied embeddings
        if src not in names:
            raise ModelError(f"the weights have no tensor {name}")
        t = weights.torch(src)
        mod_name, _, pname = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        sixteen = t.dtype in (torch.float16, torch.bfloat16)
        linear = isinstance(mod, torch.nn.Linear) and pname == "weight"
        embedding = isinstance(mod, torch.nn.Embedding) and pname == "weight"
        copied = True
        if ffn:
            t, copied = (t.clone(), True) if resident else (t, False)
        elif embedding and not tied:
            # A lookup reads one row per token: the table stays a view of the file and the OS
            # pages in the rows used (Llama-3-8B: 1 GB in bf16 not held). A tied table is the
            # head too, read whole every token: it is resident like the other matrices.
            t, copied = weights.detached(src), False
            if sixteen:
                mod.forward = types.MethodType(_widened_lookup, mod)
            elif t.dtype != torch.float32:
                t, copied = t.float(), True
        elif sixteen and (linear or embedding):
            t, copied = (t.clone(), True) if copy_rest else (t, False)
            mod.forward = types.MethodType(_mixed_forward if linear else _widened_lookup, mod)
        elif t.dtype != torch.float32:
            t = t.float()
        elif copy_rest:
            t = t.clone()
        else:
            copied = False
        mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
        if not ffn and copied:
            non_ffn += t.numel() * t.element_size()
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.get_input_embeddings().weight  # replacing embeddings broke the tie
        model.lm_head.forward = types.MethodType(_mixed_forward, model.lm_head)
    _finish_skeleton(model)
    if with_ffn:  # the skeleton's FFN Linear modules now hold full-size weights
        for i in range(layout.num_layers):
            mlp = model.get_submodule(f"{layout.prefix}.{i}.mlp")
            mlp.intermediate_size = layout.neurons
            if mlp.gate_proj.weight.dtype != torch.float32:
                model.get_submodule(f"{layout.prefix}.{i}").mlp = MmapMLP(mlp, layout.act)
    return non_ffn


def _widened_lookup(self, ids):
    """nn.Embedding over a 16-bit table: the rows looked up, widened to f32."""
    import torch

    return torch.nn.functional.embedding(ids, self.weight, self.padding_idx).float()


def _mixed_forward(self, x):
    y = mixed_linear(x, self.weight)
    return y if self.bias is None else y + self.bias.float()


def mixed_linear(x, w):
    """x (f32) times a weight in its own dtype: 16-bit weights are used as they are
    (x rounded to the weight dtype, f32 accumulation in the kernel, f32 result),
    the way llama.cpp computes with f16/bf16 weights. No f32 copy of w is made
    (engine/runtime/stored.py's native matmul)."""
    from engine.runtime.stored import ALL_ROWS, linear

    return linear(x, w, native_rows=ALL_ROWS)


def _module_base():
    import torch

    return torch.nn.Module


class MmapMLP(_module_base()):
    """The dense gated FFN over 16-bit weights: down(act(gate x) * up x), the
    same kernels and roundings as the sparse engine's 16-bit path."""

    def __init__(self, mlp, act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = ACT2FN[act]

    def forward(self, x):
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        w = self.gate_proj.weight
        v = self.act(mixed_linear(xt, w)) * mixed_linear(xt, self.up_proj.weight)  # [T, N] f32
        return mixed_linear(v, self.down_proj.weight).reshape(shape)


def ffn_bytes(layout: FFNLayout, dtype_bytes: int = 4) -> int:
    """All FFN weights of the model: 3 matrices of N x h per layer."""
    return layout.num_layers * 3 * layout.neurons * layout.hidden * dtype_bytes


def load_dense_mmap(model_dir: Path, resident: bool = False, copy_rest: bool = True):
    """The dense model with every FFN weight mmap-backed (the OS-paging baseline);
    attention, norms and embeddings are resident, exactly as in the sparse engine
    (copy_rest=False: mmap views as well -- calibration and quality runs, which hold
    no weight in RAM beyond what the OS pages in)."""
    layout = ffn_layout(model_dir)
    weights = MappedWeights(model_dir)
    model = build_skeleton(model_dir)
    put_weights(model, weights, layout, resident=resident, with_ffn=True, copy_rest=copy_rest)
    model._flotilla_weights = weights  # keep the maps alive as long as the model
    return model

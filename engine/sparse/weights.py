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

from engine.models.errors import ModelError

RELU_FAMILY = ("relu", "relu2", "relu6")  # activations with natural zeros

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64}


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


def read_config(model_dir: Path) -> dict:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {model_dir}/config.json: {e}") from None
    return cfg.get("text_config", cfg)


def ffn_layout(model_dir: Path) -> FFNLayout:
    """The FFN layout of a model folder; refuses architectures the engine cannot split."""
    cfg = read_config(model_dir)
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
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelError(f"{model_dir} has no safetensors weights (the sparse engine reads safetensors)")


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

    def numpy(self, name: str) -> np.ndarray:
        i, off, dt, shape = self._where[name]
        if _ST_DTYPES.get(dt) is None:
            raise ModelError(f"tensor {name} has dtype {dt}; the sparse engine reads F32/F16 weights")
        dtype = np.dtype(_ST_DTYPES[dt])
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(self._maps[i], dtype=dtype, count=count, offset=off).reshape(shape)

    def torch(self, name: str):
        import torch

        with warnings.catch_warnings():  # read-only buffer: we never write into it
            warnings.simplefilter("ignore")
            return torch.from_numpy(self.numpy(name))


# --------------------------------------------------------------------------- skeleton

def build_skeleton(model_dir: Path):
    """The transformers model with 1-neuron FFNs (random small weights, to be replaced)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    small = copy.deepcopy(config)
    target = getattr(small, "text_config", small)
    target.intermediate_size = 1
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    model.config = config  # what users and the generation code see is the real config
    return model.eval()


def put_weights(model, weights: MappedWeights, layout: FFNLayout, resident: bool, with_ffn: bool) -> int:
    """Put the file's weights into the skeleton. resident=True copies them into
    RAM; False leaves them mmap-backed. FFN matrices only when with_ffn.
    Returns the bytes of the non-FFN weights."""
    import torch

    non_ffn = 0
    names = set(weights.names())
    for name, _ in list(model.named_parameters()):
        if layout.is_ffn_key(name) and not with_ffn:
            continue
        src = name
        if src not in names and name == "lm_head.weight":
            src = "model.embed_tokens.weight"  # tied embeddings
        if src not in names:
            raise ModelError(f"the weights have no tensor {name}")
        t = weights.torch(src)
        if t.dtype != torch.float32:
            t = t.float()  # f16 checkpoints run in f32 (a copy: resident)
        elif resident:
            t = t.clone()
        mod_name, _, pname = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
        if not layout.is_ffn_key(name):
            non_ffn += t.numel() * 4
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.get_input_embeddings().weight  # replacing embeddings broke the tie
    if with_ffn:  # the skeleton's FFN Linear modules now hold full-size weights
        for i in range(layout.num_layers):
            model.get_submodule(f"{layout.prefix}.{i}.mlp").intermediate_size = layout.neurons
    return non_ffn


def ffn_bytes(layout: FFNLayout, dtype_bytes: int = 4) -> int:
    """All FFN weights of the model: 3 matrices of N x h per layer."""
    return layout.num_layers * 3 * layout.neurons * layout.hidden * dtype_bytes


def load_dense_mmap(model_dir: Path):
    """The whole dense model with every weight mmap-backed (the OS-paging baseline)."""
    layout = ffn_layout(model_dir)
    weights = MappedWeights(model_dir)
    model = build_skeleton(model_dir)
    put_weights(model, weights, layout, resident=False, with_ffn=True)
    model._flotilla_weights = weights  # keep the maps alive as long as the model
    return model

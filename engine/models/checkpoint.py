"""Read a Hugging Face checkpoint tensor by tensor, never the whole model.

The pipeline exporter needs one layer at a time. `Checkpoint` maps tensor
names to their safetensors file (through model.safetensors.index.json when
there is one) and reads single tensors in the dtype they are stored in.
`empty_model` builds the transformers model with every parameter on the meta
device (no memory) but real buffers (rotary inverse frequencies are computed
from the config), and `Checkpoint.load_into(module, prefix)` gives one
submodule its real weights; `release(module)` sends them back to meta.

Module names and checkpoint names differ in three known ways, handled here:
  - tied LM head: `lm_head.weight` is the embedding matrix;
  - transformers 5 stacks experts in memory, checkpoints keep them apart:
      mlp.experts.gate_up_proj [E, 2I, H] = per expert cat(gate [I, H], up [I, H])
      mlp.experts.down_proj    [E, H, I]  = per expert down [H, I]
    with per-expert names `experts.E.{gate_proj,up_proj,down_proj}.weight`
    (Qwen2/3-MoE, OLMoE) or `experts.E.{w1,w3,w2}.weight` (Mixtral);
  - Mixtral checkpoints say `block_sparse_moe` where the module says `mlp`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from engine.models.config_file import read_config as read_config_file
from engine.models.errors import ModelError
from engine.models.ref import read_safetensors_header, safetensors_files

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_PER_EXPERT = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside goes to the meta device; buffers stay real."""
    import torch
    from torch import nn

    original = nn.Module.register_parameter

    def register(self, name, param):  # noqa: ANN001 - torch's own signature
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=False)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        with torch.no_grad():
            yield
    finally:
        nn.Module.register_parameter = original


def empty_model(config: Any, dtype: Any) -> Any:
    """The CausalLM of `config` with meta parameters (no weight memory) and real buffers."""
    from transformers import AutoModelForCausalLM

    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class Checkpoint:
    """The safetensors tensors of a HF folder, read one at a time."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        files = safetensors_files(self.path)  # every shard named by the index must exist
        if not files:
            raise ModelError(f"{self.path} has no .safetensors weights (the pipeline exporter reads safetensors)")
        self.where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                if name == "__metadata__":
                    continue
                self.where[name] = f
                self.dtypes[name] = info["dtype"]
                self.shapes[name] = tuple(info["shape"])
        self._handles: dict[Path, Any] = {}

    # -- reading ---------------------------------------------------------

    def dtype(self) -> Any:
        """torch dtype most weights are stored in (bf16 / f16 / f32)."""
        import torch

        counts: dict[str, int] = {}
        for name, dt in self.dtypes.items():
            if dt in _ST_DTYPES:
                n = 1
                for d in self.shapes[name]:
                    n *= d
                counts[dt] = counts.get(dt, 0) + n
        if not counts:
            raise ModelError(f"{self.path}: no bf16/f16/f32 weights found")
        return getattr(torch, _ST_DTYPES[max(counts, key=counts.get)])

    def tensor(self, name: str) -> Any:
        from safetensors import safe_open

        f = self.where.get(name)
        if f is None:
            raise ModelError(f"{self.path.name}: tensor {name} is not in the checkpoint")
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(name)

    def _per_expert(self, module_name: str, part: str, e: int) -> Any:
        """One expert's gate/up/down matrix by any of the per-expert spellings."""
        base = module_name.rsplit(".", 1)[0]  # ...mlp.experts
        for b in (base, base.replace(".mlp.", ".block_sparse_moe.")):
            for spelling in _PER_EXPERT[part]:
                name = f"{b}.{e}.{spelling}.weight"
                if name in self.where:
                    return self.tensor(name)
        raise ModelError(f"{self.path.name}: no checkpoint tensor for expert {e} {part} of {base}")

    def for_param(self, name: str, shape: tuple[int, ...]) -> Any:
        """The checkpoint data of module parameter `name` (shape-checked)."""
        import torch

        if name in self.where:
            t = self.tensor(name)
        elif name == "lm_head.weight" and "model.embed_tokens.weight" in self.where:
            t = self.tensor("model.embed_tokens.weight")  # tied embeddings
        elif name.endswith(".experts.gate_up_proj"):
            # [E, 2I, H]: per expert cat(gate [I, H], up [I, H]) on dim 0
            t = torch.stack([torch.cat((self._per_expert(name, "gate", e), self._per_expert(name, "up", e)))
                             for e in range(shape[0])])
        elif name.endswith(".experts.down_proj"):
            t = torch.stack([self._per_expert(name, "down", e) for e in range(shape[0])])  # [E, H, I]
        elif name.replace(".mlp.", ".block_sparse_moe.") in self.where:
            t = self.tensor(name.replace(".mlp.", ".block_sparse_moe."))
        else:
            raise ModelError(f"{self.path.name}: tensor {name} is not in the checkpoint")
        if tuple(t.shape) != tuple(shape):
            raise ModelError(f"{self.path.name}: tensor {name} has shape {list(t.shape)}, "
                             f"the config says {list(shape)}")
        return t

    # -- modules ---------------------------------------------------------

    def load_into(self, module: Any, prefix: str, dtype: Any = None) -> int:
        """Give every meta parameter of `module` (named `prefix`.*) its checkpoint
        data, cast to `dtype` when given; returns the bytes loaded."""
        from torch import nn

        loaded = 0
        for name, param in list(module.named_parameters()):
            if param.device.type != "meta":
                continue
            t = self.for_param(f"{prefix}.{name}" if prefix else name, tuple(param.shape))
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            owner._parameters[name.rsplit(".", 1)[-1]] = nn.Parameter(t, requires_grad=False)
            loaded += t.numel() * t.element_size()
        return loaded

    def close(self) -> None:
        self._handles.clear()


def release(module: Any) -> None:
    """Send a submodule's parameters back to the meta device (frees their memory)."""
    from torch import nn

    for name, param in list(module.named_parameters()):
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        owner._parameters[name.rsplit(".", 1)[-1]] = nn.Parameter(param.detach().to("meta"), requires_grad=False)


def read_config(path: Path) -> Any:
    """The transformers config of a folder, with a one-line error for a bad one."""
    from transformers import AutoConfig

    read_config_file(path)  # a missing or broken file: our one-line error, not transformers'
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as e:
        raise ModelError(f"{path.name}: transformers cannot read its config.json ({e})") from None

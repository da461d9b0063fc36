"""Convert a Hugging Face MoE checkpoint into an expert store (see store.py).

Handles both ways checkpoints hold experts:
  * per expert (what transformers 5 still writes, and every hub checkpoint):
      Mixtral   layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight  (gate, up, down)
      Qwen2/3-MoE, OLMoE   layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight
  * stacked (transformers 5 module layout):
      layers.L.mlp.experts.gate_up_proj [E, 2I, H] and .down_proj [E, H, I]
Everything else (attention, norms, routers, Qwen2-MoE's shared expert) goes
into rest.safetensors under the names the transformers 5 modules use
(`block_sparse_moe.` becomes `mlp.`), and stays resident.

Weights keep the checkpoint's dtype (a bf16 checkpoint gives a bf16 store of the
same expert bytes), or become int8 on request (`weights="int8"`). Conversion
streams: one expert, or one resident tensor, in memory at a time.

The store is written into a temporary folder and renamed into place, so an
interrupted conversion never leaves a half-written store behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.models.config_file import read_text_config
from engine.moe.store import (ALIGN, BLOB_FILE, INDEX_FILE, REST_FILE, STORE_VERSION, BlobInfo, StoreError,
                              StoreIndex, align_up, blob_parts, checksum, default_checksum)
from engine.runtime.stored import ST_DTYPES, STORAGE_DTYPES, dtype_name, quantize_rows

Progress = Callable[[str, float], None]

# layers.L.(mlp|block_sparse_moe).experts.E.(proj).weight
_PER_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# layers.L.mlp.experts.(gate_up_proj|gate_proj|up_proj|down_proj)[.weight], stacked over experts
_STACKED = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                      r"(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_COPY = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
         "flotilla-demo.json")


def is_store(folder: Path, source: str | None = None) -> bool:
    """True when `folder` holds a complete store (converted from `source`, if given)."""
    try:
        d = json.loads((Path(folder) / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return ((Path(folder) / BLOB_FILE).exists() and d.get("version") == STORE_VERSION
            and (source is None or d.get("source") == source))


def convert(model_dir: Path, out_dir: Path, source: str = "", progress: Progress | None = None,
            weights: str | None = None) -> Path:
    """Write the expert store of the checkpoint in `model_dir` to `out_dir`.

    weights: None keeps the checkpoint's dtype (bf16 stays bf16); "int8" quantizes the
    experts and the big resident matrices (projections, embeddings, head) per row.
    Reads one expert (or one resident tensor) at a time from the memory-mapped files."""
    from safetensors import safe_open

    report = progress or (lambda _m, _f: None)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if weights not in (None, "int8"):
        raise StoreError(f"the moe engine keeps the checkpoint's dtype or quantizes to int8, not {weights!r}")
    config = read_text_config(model_dir)
    files = checkpoint_files(model_dir)
    handles = {f: safe_open(str(f), framework="pt") for f in files}
    where = {name: f for f, h in handles.items() for name in h.keys()}

    # Sort the tensor names: expert parts by (layer, expert, role), the rest by name.
    per: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    stacked: dict[int, dict[str, str]] = defaultdict(dict)
    rest: list[str] = []
    for name in where:
        if m := _PER_EXPERT.search(name):
            per[(int(m.group(1)), int(m.group(2)))][_ROLE[m.group(3)]] = name
        elif m := _STACKED.search(name):
            stacked[int(m.group(1))][m.group(2)] = name
        else:
            rest.append(name)
    if not per and not stacked:
        raise StoreError(f"{model_dir} has no routed experts (is it a MoE model?)")

    def load(name: str):
        return handles[where[name]].get_tensor(name)

    def expert_tensors(layer: int, e: int):
        """(gate [I,H], up [I,H], down [H,I]) of one expert, in the checkpoint's dtype."""
        if (layer, e) in per:
            p = per[(layer, e)]
            missing = {"gate", "up", "down"} - set(p)
            if missing:
                raise StoreError(f"expert {e} of layer {layer} lacks {', '.join(sorted(missing))}")
            return load(p["gate"]), load(p["up"]), load(p["down"])
        s = stacked[layer]
        if "gate_up_proj" in s:
            gu = handles[where[s["gate_up_proj"]]].get_slice(s["gate_up_proj"])[e]  # [2I, H]
            inter = gu.shape[0] // 2
            gate, up = gu[:inter], gu[inter:]
        else:
            gate = handles[where[s["gate_proj"]]].get_slice(s["gate_proj"])[e]
            up = handles[where[s["up_proj"]]].get_slice(s["up_proj"])[e]
        down = handles[where[s["down_proj"]]].get_slice(s["down_proj"])[e]
        return gate, up, down

    keys = sorted(set(per) | {(layer, e) for layer, s in stacked.items()
                              for e in range(_stacked_count(handles, where, s))})
    layer0, e0 = keys[0]
    gate, up, down = expert_tensors(layer0, e0)
    inter, hidden = gate.shape
    if down.shape[0] != hidden and down.shape[1] == hidden:  # some exports hold down as [I, H]
        raise StoreError(f"unexpected down_proj shape {tuple(down.shape)} (want [{hidden}, {inter}])")
    source_dtype = dtype_name(gate.dtype)
    dtype = weights or source_dtype
    parts, data_bytes = blob_parts(inter, hidden, dtype)
    blob_bytes = align_up(data_bytes)
    algo = default_checksum()

    def blob_of(gate, up, down, buf: np.ndarray) -> None:
        """One expert's parts into buf (zero padded), as `parts` lays them out."""
        gate_up = torch.cat([gate, up])  # [2I, H]
        if dtype == "int8":
            (gu, gu_s), (dn, dn_s) = quantize_rows(gate_up), quantize_rows(down)
            tensors = {"gate_up": gu, "down": dn, "gate_up_scale": gu_s, "down_scale": dn_s}
        else:
            tensors = {"gate_up": gate_up.to(STORAGE_DTYPES[dtype]), "down": down.to(STORAGE_DTYPES[dtype])}
        buf[:] = 0
        for part in parts:
            raw = tensors[part.name].contiguous().view(torch.uint8).numpy().ravel()
            buf[part.offset:part.offset + part.nbytes] = raw

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        blobs: dict[tuple[int, int], BlobInfo] = {}
        buf = np.zeros(blob_bytes, dtype=np.uint8)
        with open(tmp / BLOB_FILE, "wb") as f:
            for i, (layer, e) in enumerate(keys):
                gate, up, down = expert_tensors(layer, e)
                if tuple(gate.shape) != (inter, hidden) or tuple(down.shape) != (hidden, inter):
                    raise StoreError(f"expert {e} of layer {layer} has shapes unlike expert {e0} of layer {layer0}")
                blob_of(gate, up, down, buf)
                offset = f.tell()
                assert offset % ALIGN == 0
                f.write(buf.data)
                blobs[(layer, e)] = BlobInfo(offset, checksum(algo, buf))
                if i % 64 == 0:
                    report(f"writing expert blobs ({i}/{len(keys)})", 0.1 + 0.7 * i / len(keys))
            f.flush()
            os.fsync(f.fileno())
        # The rest, under transformers 5 module names; expert tensors are left out.
        report("writing the resident weights", 0.85)
        write_rest(tmp / REST_FILE, [(name, handles[where[name]]) for name in sorted(rest)], weights)
        for name in _COPY:
            if (model_dir / name).exists():
                shutil.copy2(model_dir / name, tmp / name)
        num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        index = StoreIndex(
            model_type=str(config.get("model_type", "")), num_layers=int(config["num_hidden_layers"]),
            moe_layers=tuple(sorted({k[0] for k in keys})),
            num_experts=num_experts or 1 + max(k[1] for k in keys),
            top_k=int(config.get("num_experts_per_tok") or 2), hidden=int(hidden), intermediate=int(inter),
            blob_bytes=blob_bytes, data_bytes=data_bytes, parts=parts, checksum_algo=algo, blobs=blobs,
            source=source, dtype=dtype, source_dtype=source_dtype)
        (tmp / INDEX_FILE).write_text(json.dumps(index.to_json()), encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    report("expert store ready", 1.0)
    return out_dir


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (engine.models.ref: every shard its index lists
    must be there); StoreError with one line otherwise."""
    from engine.models.errors import ModelError
    from engine.models.ref import safetensors_files

    try:
        files = safetensors_files(Path(model_dir))
    except ModelError as e:
        raise StoreError(str(e)) from None
    if not files:
        raise StoreError(f"{model_dir} has no safetensors weights (the MoE engine needs them)")
    return files


def quantized(name: str, shape) -> bool:
    """Resident tensors that int8 stores quantize: the big matrices (attention and shared-expert
    projections, dense FFNs, embeddings, head). Norms, biases and routers keep their dtype."""
    return len(shape) == 2 and name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))


def write_rest(path: Path, items: list[tuple[str, object]], weights: str | None) -> None:
    """A safetensors file of the resident tensors (name, safe_open handle), written one
    tensor at a time (the header first, from the shapes), renamed `block_sparse_moe.` ->
    `mlp.`; int8 adds `<name>.qscale` (f32 [rows]) beside each quantized matrix."""
    plan = []  # (out name, source name, handle, what: "copy" | "q" | "s", dtype, shape)
    for name, h in items:
        sl = h.get_slice(name)
        shape, st_dtype = list(sl.get_shape()), sl.get_dtype()
        out = name.replace(".block_sparse_moe.", ".mlp.")
        if weights == "int8" and quantized(name, shape):
            plan.append((out, name, h, "q", "I8", shape))
            plan.append((out + SCALE_SUFFIX, name, h, "s", "F32", shape[:1]))
        else:
            plan.append((out, name, h, "copy", st_dtype, shape))
    header, offset = {}, 0
    for out, _n, _h, _w, st_dtype, shape in plan:
        n = ST_DTYPES[st_dtype].itemsize
        for d in shape:
            n *= int(d)
        header[out] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        pending: dict[str, torch.Tensor] = {}  # scales of the matrix just quantized
        for out, name, h, what, _d, _s in plan:
            if what == "s":
                t = pending.pop(name)
            else:
                t = h.get_tensor(name)
                if what == "q":
                    t, pending[name] = quantize_rows(t)
            f.write(t.contiguous().view(torch.uint8).numpy().data)
            del t
        f.flush()
        os.fsync(f.fileno())


SCALE_SUFFIX = ".qscale"


def _stacked_count(handles, where, s: dict[str, str]) -> int:
    name = s.get("gate_up_proj") or s.get("gate_proj") or s["down_proj"]
    return int(handles[where[name]].get_slice(name).get_shape()[0])


def store_dir_for(model_dir: Path, fingerprint: str, weights: str | None = None) -> Path:
    """Where the store of a model lives: the Flotilla cache, never the user's folder."""
    from engine.models.demo import cache_root

    tail = f"-{weights}" if weights else ""
    return cache_root() / "moe-store" / f"{Path(model_dir).name}-{fingerprint}{tail}"


def ensure_store(model_dir: Path, fingerprint: str, progress: Progress | None = None,
                 weights: str | None = None) -> Path:
    """The store of a checkpoint, converted once and reused while its fingerprint holds."""
    out = store_dir_for(model_dir, fingerprint, weights)
    if not is_store(out, fingerprint):
        convert(model_dir, out, source=fingerprint, progress=progress, weights=weights)
    return out

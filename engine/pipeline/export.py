"""Export a layer range [start, end) of a HF causal LM to a stateful OpenVINO shard.

A shard is `shard.xml/.bin` + `shard.json` (a `ShardInfo`). Its KV cache is
stateful (ReadValue/Assign) and, with `fuse_beam_idx=True`, every past K/V is
read through `Gather(ReadValue, beam_idx, 0)` before the concat, which is the
pattern the CPU plugin's `StatefulSDPAFusion` (GPU: `IndirectKVCache`) folds
into one SDPA-with-KV-cache node. `fused_sdpa_nodes` proves it on a compiled
model: on CPU the runtime node has layerType "ScaledDotProductAttention",
takes beam_idx and the past K/V straight from "MemoryInput" (ReadValue) nodes,
and has three outputs (attention, present K, present V) that feed the
"MemoryOutput" (Assign) nodes; its rt_info carries "kv_cache_precision".
Without beam_idx the CPU plugin (2026.4) does not even keep an SDPA node: the
attention is decomposed into MatMul/Softmax after a separate Concatenation,
and a decode step of a 4-layer demo shard costs ~2x more.

Shard I/O (n = tokens this call, T = past + n):
  first stage  input_ids      int64 [1, n]
  other stages hidden_states  f32   [1, n, H]
  all          attention_mask int64 [1, T]   1 visible, 0 hidden (mask rollback)
               position_ids   int64 [1, n]   logical positions
               beam_idx       int32 [1]      (with fuse_beam_idx)
  non-last     hidden_states_out f32 [1, n, H]
  last         logits f32 [1, n, V], next_token int64 [1, n] (greedy argmax)
State: per layer key/value f32 [1, kv_heads, T, head_dim].
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

# Bumped whenever the traced graph or the manifest changes, so cached shards
# exported by an older Flotilla are rebuilt instead of reused.
EXPORT_FORMAT_VERSION = 1
PRECISIONS = ("f32", "fp16", "int8", "int4")
MANIFEST = "shard.json"
XML = "shard.xml"


@dataclass(frozen=True)
class ShardInfo:
    """What a worker needs to know about an exported shard (= shard.json)."""

    path: str  # folder holding shard.xml/.bin/.json
    start: int  # first decoder layer (inclusive)
    end: int  # last decoder layer (exclusive)
    num_layers_total: int  # decoder layers of the whole model
    model_type: str  # transformers model_type, e.g. "llama"
    hidden_size: int  # width of hidden_states between stages
    vocab_size: int  # logits width (last stage)
    num_kv_heads: int  # KV state dim 1
    head_dim: int  # KV state dim 3
    precision: str  # f32 | fp16 | int8 | int4 (weights)
    fuse_beam_idx: bool  # Gather(ReadValue, beam_idx) inserted before each concat
    model_fingerprint: str  # identifies the source weights + config
    openvino_version: str  # OpenVINO that wrote the IR
    inputs: list[str] = field(default_factory=list)  # IR input names, in order
    outputs: list[str] = field(default_factory=list)  # IR output names, in order
    states: list[str] = field(default_factory=list)  # variable ids, key/value per layer
    format_version: int = EXPORT_FORMAT_VERSION  # of this manifest and graph

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers_total

    @property
    def xml(self) -> Path:
        return Path(self.path) / XML

    @classmethod
    def load(cls, folder: Path) -> "ShardInfo":
        data = json.loads((Path(folder) / MANIFEST).read_text())
        data["path"] = str(Path(folder))
        return cls(**data)


# -- identity and cache ------------------------------------------------------


def model_fingerprint(model_path: Path) -> str:
    """A cheap identity of a HF folder: config + weight file names, sizes, ends.

    A demo model's own recipe fingerprint is used when present. Full hashing
    of multi-GB weights is avoided: the safetensors header (tensor names,
    shapes, offsets) sits in the first MiB, and a sample of the tail catches
    re-trained weights of identical layout.
    """
    model_path = Path(model_path)
    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    demo = model_path / "flotilla-demo.json"
    if demo.exists():
        h.update(json.loads(demo.read_text()).get("fingerprint", "").encode())
    weights = sorted(p for p in model_path.iterdir() if p.suffix in (".safetensors", ".bin"))
    for p in weights:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:20]


def _exporter_digest() -> str:
    """Digest of the traced forward's and the compressor's source, so editing
    either invalidates cached shards."""
    h = hashlib.sha256()
    for name in ("shard_model.py", "compress.py"):
        h.update(Path(__file__).with_name(name).read_bytes())
    return h.hexdigest()[:12]


def shard_cache_key(model_fingerprint: str, start: int, end: int, precision: str,
                    openvino_version: str, *, fuse_beam_idx: bool = True) -> str:
    """Content address of a shard: same inputs (and same exporter code), same IR."""
    blob = json.dumps([EXPORT_FORMAT_VERSION, _exporter_digest(), model_fingerprint, start, end,
                       precision, openvino_version, fuse_beam_idx])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def shard_cache_root() -> Path:
    from engine.models.demo import cache_root

    return cache_root() / "shards"


def ensure_shard(model_path: Path, start: int, end: int, *, num_layers_total: int | None = None,
                 precision: str = "f32", fuse_beam_idx: bool = True,
                 cache: Path | None = None, hf_model: Any = None) -> ShardInfo:
    """Return the cached shard for this range, exporting it first if missing.

    The export is written to a temporary folder next to the cache entry and
    renamed into place, so an interrupted export leaves nothing behind.
    `hf_model` may pass the already loaded model (only read on a miss).
    """
    import openvino as ov

    root = Path(cache) if cache is not None else shard_cache_root()
    key = shard_cache_key(model_fingerprint(model_path), start, end, precision,
                          ov.get_version(), fuse_beam_idx=fuse_beam_idx)
    target = root / key
    if (target / MANIFEST).exists():
        return ShardInfo.load(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        export_shard(model_path, start, end, tmp, num_layers_total=num_layers_total,
                     precision=precision, fuse_beam_idx=fuse_beam_idx, hf_model=hf_model)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process exported the same shard first: theirs is identical.
            if not (target / MANIFEST).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return ShardInfo.load(target)


# -- export ------------------------------------------------------------------


def _load_hf(model_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    return model


def export_shard(model_path: Path, start: int, end: int, out_dir: Path, *,
                 num_layers_total: int | None = None, precision: str = "f32",
                 fuse_beam_idx: bool = True, hf_model: Any = None) -> ShardInfo:
    """Trace layers [start, end) of the model at `model_path` into `out_dir`.

    `hf_model` may pass an already loaded model (tests export many ranges).
    """
    import openvino as ov
    import torch

    from engine.pipeline.shard_model import ShardModule

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    model_path, out_dir = Path(model_path), Path(out_dir)
    model = hf_model if hf_model is not None else _load_hf(model_path)
    total = model.config.num_hidden_layers
    if num_layers_total is not None and num_layers_total != total:
        raise ValueError(f"plan says {num_layers_total} layers but the model has {total}")
    module = ShardModule(model, start, end).eval()
    geo = module.geo
    n_layers = end - start

    # Example: 3 new tokens over 2 past ones (shape-only; dims are dynamic below).
    past_len, n = 2, 3
    x = (torch.ones(1, n, dtype=torch.long) if module.first
         else torch.zeros(1, n, geo.hidden_size, dtype=torch.float32))
    mask = torch.ones(1, past_len + n, dtype=torch.long)
    pos = torch.arange(past_len, past_len + n, dtype=torch.long)[None]
    kv = torch.zeros(1, geo.num_kv_heads, past_len, geo.head_dim)
    past = [kv.clone() for _ in range(2 * n_layers)]

    x_name = "input_ids" if module.first else "hidden_states"
    past_names, present_names = [], []
    for layer in range(start, end):
        past_names += [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        present_names += [f"present.{layer}.key", f"present.{layer}.value"]
    in_names = [x_name, "attention_mask", "position_ids", *past_names]
    out_names = (["logits", "next_token"] if module.last else ["hidden_states_out"]) + present_names

    x_shape = [-1, -1] if module.first else [-1, -1, geo.hidden_size]
    spec = [(ov.PartialShape(x_shape), ov.Type.i64 if module.first else ov.Type.f32),
            (ov.PartialShape([-1, -1]), ov.Type.i64),
            (ov.PartialShape([-1, -1]), ov.Type.i64)]
    spec += [(ov.PartialShape([-1, geo.num_kv_heads, -1, geo.head_dim]), ov.Type.f32)] * len(past)
    with torch.no_grad():
        ov_model = ov.convert_model(module, example_input=(x, mask, pos, *past), input=spec)
    for port, name in zip(ov_model.inputs, in_names):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, out_names):
        port.get_tensor().set_names({name})

    if fuse_beam_idx:
        _fuse_cache_reorder(ov_model, past_names)
    _make_stateful(ov_model, dict(zip(past_names, present_names)), x_name)

    if precision in ("int8", "int4"):  # NNCF weight compression (engine/pipeline/compress.py)
        from engine.pipeline.compress import compress_model

        ov_model = compress_model(ov_model, precision)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov_model, str(out_dir / XML), compress_to_fp16=(precision == "fp16"))
    info = ShardInfo(
        path=str(out_dir), start=start, end=end, num_layers_total=total,
        model_type=model.config.model_type, hidden_size=geo.hidden_size,
        vocab_size=geo.vocab_size, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
        precision=precision, fuse_beam_idx=fuse_beam_idx,
        model_fingerprint=model_fingerprint(model_path), openvino_version=ov.get_version(),
        inputs=[p.get_any_name() for p in ov_model.inputs],
        outputs=[p.get_any_name() for p in ov_model.outputs],
        states=_ordered_states(ov_model, past_names),
    )
    manifest = asdict(info)
    del manifest["path"]
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return info


def _ordered_states(ov_model, past_names: list[str]) -> list[str]:
    """Variable ids (OpenVINO names them input + output name) in layer order."""
    ids = [op.get_variable_id() for op in ov_model.get_ops() if op.get_type_name() == "ReadValue"]
    rank = {name: i for i, name in enumerate(past_names)}
    return sorted(ids, key=lambda v: next((i for n, i in rank.items() if v.startswith(n + "present")), len(rank)))


def _fuse_cache_reorder(ov_model, past_names: list[str]) -> None:
    """Add `beam_idx` (int32 [batch]) and read every past K/V through Gather(., beam_idx, 0).

    Same idea as optimum-intel's fuse_cache_reorder: after make_stateful the
    Gather sits between ReadValue and the concat, the pattern the plugins fuse.
    """
    import openvino as ov
    from openvino import opset13

    batch = ov_model.inputs[0].get_partial_shape()[0]
    beam_idx = opset13.parameter(ov.PartialShape([batch]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    axis = opset13.constant(np.int64(0))
    for name in past_names:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, axis)
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()


def _make_stateful(ov_model, pairs: dict[str, str], x_name: str) -> None:
    """Turn past/present pairs into ReadValue/Assign; initialise states empty.

    The initial value of each state is zeros [batch, kv_heads, 0, head_dim]
    with batch read from the main input, so `reset_state()` alone yields a
    valid empty cache.
    """
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(ov_model, pairs)
    x = ov_model.input(x_name)
    batch = opset13.gather(opset13.shape_of(x, output_type="i64"), opset13.constant(np.array([0], np.int64)),
                           opset13.constant(np.int64(0)))
    for op in ov_model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims = [d.get_length() if d.is_static else 0 for d in op.get_output_partial_shape(0)]
        parts = [batch] + [opset13.constant(np.array([d], np.int64)) for d in dims[1:]]
        shape = opset13.concat(parts, axis=0)
        zero = opset13.constant(np.array(0.0, dtype=np.float32)).output(0)
        op.set_arguments([opset13.broadcast(opset13.convert(zero, op.get_output_element_type(0)), shape)])
    ov_model.validate_nodes_and_infer_types()


# -- fusion check ------------------------------------------------------------


def _layer_type(node) -> str:
    info = node.get_rt_info()
    return info["layerType"].astype(str) if "layerType" in info else node.get_type_name()


def fused_sdpa_nodes(compiled) -> list[str]:
    """Names of runtime SDPA nodes that read the KV state directly (fused KV cache).

    CPU: StatefulSDPAFusion turns ReadValue -> Gather(beam_idx) -> Concat ->
    SDPA into one "ScaledDotProductAttention" node whose inputs include the
    "MemoryInput" state nodes. GPU: the fused kernel is expected to show up as
    an "IndirectSDPA" layer type (not verified on hardware here).
    """
    names = []
    for node in compiled.get_runtime_model().get_ops():
        kind = _layer_type(node)
        if kind in ("IndirectSDPA", "indirect_sdpa"):
            names.append(node.get_friendly_name())
            continue
        if kind != "ScaledDotProductAttention":
            continue
        sources = {_layer_type(i.get_source_output().get_node()) for i in node.inputs()}
        if "MemoryInput" in sources:
            names.append(node.get_friendly_name())
    return names


def runtime_op_counts(compiled) -> dict[str, int]:
    """layerType -> count of a compiled model's runtime graph (for reports)."""
    counts: dict[str, int] = {}
    for node in compiled.get_runtime_model().get_ops():
        kind = _layer_type(node)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# -- running -----------------------------------------------------------------


class ShardStream:
    """One user's InferRequest and KV state on one shard."""

    def __init__(self, runner: "ShardRunner"):
        self.runner = runner
        self.request = runner.compiled.create_infer_request()
        self.reset()

    def reset(self) -> None:
        """Empty KV cache: every state set to [1, kv_heads, 0, head_dim]."""
        import openvino as ov

        info = self.runner.info
        self.request.reset_state()
        empty = np.zeros((1, info.num_kv_heads, 0, info.head_dim), np.float32)
        for state in self.request.query_state():
            state.state = ov.Tensor(empty)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = dict(inputs)
        if "beam_idx" in self.runner.input_names and "beam_idx" not in feed:
            some = next(iter(feed.values()))
            feed["beam_idx"] = np.zeros(some.shape[0], np.int32)
        # Shared in/out buffers skip two copies per call; outputs are copied once
        # here because the next infer() overwrites them.
        self.request.infer(feed, share_inputs=True, share_outputs=True)
        return {name: self.request.get_tensor(port).data.copy()
                for name, port in self.runner.output_ports.items()}


class ShardRunner:
    """A compiled shard; `new_stream()` gives each user its own request + state."""

    def __init__(self, info: ShardInfo | Path, device: str = "CPU", *, exact: bool = False,
                 cache_dir: Path | None = None, core: Any = None, config: dict | None = None):
        import openvino as ov

        self.info = info if isinstance(info, ShardInfo) else ShardInfo.load(Path(info))
        self.core = core or ov.Core()
        cfg: dict[str, Any] = {}
        if exact:  # bit-comparable with torch f32: no bf16/fp16 compute, f32 KV cache
            cfg.update({"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
        if cache_dir is not None:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            cfg["CACHE_DIR"] = str(cache_dir)
        cfg.update(config or {})
        self.compiled = self.core.compile_model(str(self.info.xml), device, cfg)
        self.input_names = [p.get_any_name() for p in self.compiled.inputs]
        self.output_ports = {p.get_any_name(): p for p in self.compiled.outputs}

    def new_stream(self) -> ShardStream:
        return ShardStream(self)

    def fused_sdpa_nodes(self) -> list[str]:
        return fused_sdpa_nodes(self.compiled)

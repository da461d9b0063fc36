"""Export a layer range [start, end) of a HF causal LM to a stateful OpenVINO shard.

Streaming: the exporter never holds the model. It builds the transformers
model with meta parameters (engine/models/checkpoint.py), then traces the
shard piece by piece — the embedding (first stage), each decoder layer, the
final norm + LM head (last stage) — loading only that piece's tensors from the
safetensors files in the checkpoint's dtype, converting it with OpenVINO
(16-bit weights stay 16-bit constants: `__make_16bit_traceable`), compressing
it (NNCF int8 / int4, engine/pipeline/compress.py) and saving it to a
temporary IR before the next piece loads. The pieces are then read back
(weights memory-mapped) and stitched into one graph, made stateful and saved.
Peak memory: about one piece in torch plus its converted copy, plus the
output shard being written (mapped, reclaimable file pages).

The KV cache is stateful (ReadValue/Assign) and, with `fuse_beam_idx=True`,
every past K/V is read through `Gather(ReadValue, beam_idx, 0)` before the
concat, which is the pattern the CPU plugin's `StatefulSDPAFusion` (GPU:
`IndirectKVCache`) folds into one SDPA-with-KV-cache node
(`shard_runtime.fused_sdpa_nodes` proves it on a compiled model). Without
beam_idx the CPU plugin (2026.4) decomposes attention, ~2x slower per step.

Shard I/O (n = tokens this call, T = past + n):
  first stage  input_ids      int64 [1, n]
  other stages hidden_states  f32   [1, n, H]
  all          attention_mask int64 [1, T]   1 visible, 0 hidden (mask rollback)
               position_ids   int64 [1, n]   logical positions
               beam_idx       int32 [1]      (with fuse_beam_idx)
  last         logits_to_keep int64 [1]      logits of the last k positions only, 0 = all
                                             (1 when decoding or prefilling; K+1 to verify)
  non-last     hidden_states_out f32 [1, n, H]
  last         logits f32 [1, c, V], next_token int64 [1, c] (greedy argmax), c = min(k, n) or n
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
from typing import Any, Callable, Mapping

import numpy as np

# Bumped whenever the traced graph or the manifest changes, so cached shards
# exported by an older Flotilla are rebuilt instead of reused.
EXPORT_FORMAT_VERSION = 2
PRECISIONS = ("f32", "bf16", "fp16", "int8", "int4")
Progress = Callable[[str, float], None]  # (message, fraction done)
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
    # Routed MoE experts' weights in this shard at its precision (0: dense), which a CPU
    # runtime holds twice (plan_memory.EXPERT_COPIES): the agent's start check adds them.
    expert_bytes: int = 0

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
    """Digest of the source that decides a shard's graph and weights (this
    exporter, the traced pieces, the compressor, the checkpoint reader), so
    editing any of it invalidates cached shards."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for f in sorted(here.glob("shard_*.py")) + [here / "export.py", here / "compress.py",
                                                   here.parent / "models" / "checkpoint.py"]:
        if f.name != "shard_runtime.py":  # running shards does not change them
            h.update(f.name.encode() + f.read_bytes())
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
                 cache: Path | None = None, progress: Progress | None = None) -> ShardInfo:
    """Return the cached shard for this range, exporting it first if missing.

    The export is written to a temporary folder `.<key>-<pid>-*` next to the
    cache entry and renamed into place only when complete, so an interrupted
    export (killed, out of memory) never leaves a shard that looks finished;
    the temporary folders of exporters that are gone are removed here.
    """
    import openvino as ov

    root = Path(cache) if cache is not None else shard_cache_root()
    key = shard_cache_key(model_fingerprint(model_path), start, end, precision,
                          ov.get_version(), fuse_beam_idx=fuse_beam_idx)
    target = root / key
    if (target / MANIFEST).exists():
        return ShardInfo.load(target)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-{os.getpid()}-", dir=root))
    try:
        export_shard(model_path, start, end, tmp, num_layers_total=num_layers_total,
                     precision=precision, fuse_beam_idx=fuse_beam_idx, progress=progress)
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


def remove_stale_exports(root: Path) -> list[Path]:
    """Delete `.<key>-<pid>-*` temporary export folders whose exporter process is gone."""
    import psutil

    removed = []
    for d in Path(root).glob(".*-*-*"):
        parts = d.name[1:].split("-")
        if len(parts) < 3 or not parts[1].isdigit() or not d.is_dir():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or psutil.pid_exists(pid):
            continue  # an export still running (here in another thread, or elsewhere)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


# -- export ------------------------------------------------------------------


def _load_hf(model_path: Path):
    """The whole model in f32 (for references and benches only; the exporter streams)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    return model


def export_shard(model_path: Path, start: int, end: int, out_dir: Path, *,
                 num_layers_total: int | None = None, precision: str = "f32",
                 fuse_beam_idx: bool = True, progress: Progress | None = None) -> ShardInfo:
    """Trace layers [start, end) of the model at `model_path` into `out_dir`, one piece at a time."""
    import openvino as ov

    from engine.models.checkpoint import Checkpoint, empty_model, read_config
    from engine.pipeline.shard_model import check_supported, geometry

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    model_path, out_dir = Path(model_path), Path(out_dir)
    report = progress or (lambda _m, _f: None)
    config = read_config(model_path)
    check_supported(config)
    total = config.num_hidden_layers
    if num_layers_total is not None and num_layers_total != total:
        raise ValueError(f"plan says {num_layers_total} layers but the model has {total}")
    if not 0 <= start < end <= total:
        raise ValueError(f"layer range [{start}, {end}) is not inside [0, {total})")
    ckpt = Checkpoint(model_path)
    geo = geometry(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".pieces-", dir=out_dir))
    try:
        skeleton = empty_model(config, ckpt.dtype())
        pieces = plan_pieces(ckpt, start, end, total, precision)
        xmls = []
        for k, piece in enumerate(pieces):
            report(f"exporting {piece.label} ({k + 1}/{len(pieces)})", k / (len(pieces) + 1))
            xmls.append(_export_piece(skeleton, ckpt, piece, geo, precision, work / f"{k:03d}.xml"))
        report("stitching the shard", len(pieces) / (len(pieces) + 1))
        ov_model, past_names, present_names = _stitch(xmls, [p.label for p in pieces])
        x_name = "input_ids" if start == 0 else "hidden_states"
        if fuse_beam_idx:
            _fuse_cache_reorder(ov_model, past_names)
        _make_stateful(ov_model, dict(zip(past_names, present_names)), x_name)
        ov.save_model(ov_model, str(out_dir / XML), compress_to_fp16=False)
        info = ShardInfo(
            path=str(out_dir), start=start, end=end, num_layers_total=total,
            model_type=config.model_type, hidden_size=geo.hidden_size,
            vocab_size=geo.vocab_size, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
            precision=precision, fuse_beam_idx=fuse_beam_idx,
            model_fingerprint=model_fingerprint(model_path), openvino_version=ov.get_version(),
            inputs=[p.get_any_name() for p in ov_model.inputs],
            outputs=[p.get_any_name() for p in ov_model.outputs],
            states=_ordered_states(ov_model, past_names),
            expert_bytes=_expert_bytes(model_path, start, end, precision),
        )
        del ov_model
    finally:
        ckpt.close()
        shutil.rmtree(work, ignore_errors=True)
    manifest = asdict(info)
    del manifest["path"]
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    report("shard exported", 1.0)
    return info


def _expert_bytes(model_path: Path, start: int, end: int, precision: str) -> int:
    """Routed-expert bytes of layers [start, end) at precision, as the planner counts them."""
    from engine.models import profile_model
    from engine.pipeline.plan import PlanModel

    return int(sum(PlanModel.from_profile(profile_model(model_path)).expert_weight_bytes(precision)[start:end]))


# -- pieces ------------------------------------------------------------------

# Checkpoint bytes traced at once. One Llama-3.1-8B layer is 436 MB in bf16 (one
# layer a piece); a demo model is one piece (tracing costs ~1 s a piece
# whatever its size). The embedding and the head count like layers: a 128k
# vocabulary makes each 0.5–1 GB, so they are usually pieces of their own.
PIECE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Piece:
    """One traced part of a shard: optional embedding, layers [start, end), optional head."""

    embed: bool  # token embedding (first stage)
    start: int  # first decoder layer
    end: int  # end of its layers (== start: no layers)
    head: bool  # final norm + LM head (last stage)

    @property
    def label(self) -> str:
        parts = (["embed"] if self.embed else []) + \
            ([f"layers {self.start}-{self.end - 1}"] if self.end > self.start else []) + (["head"] if self.head else [])
        return " + ".join(parts)


def _stored_bytes(ckpt, prefix: str) -> int:
    total = 0
    for name, shape in ckpt.shapes.items():
        if name.startswith(prefix):
            n = 2 if ckpt.dtypes[name] in ("BF16", "F16") else 4
            for d in shape:
                n *= d
            total += n
    return total


def plan_pieces(ckpt, start: int, end: int, total: int, precision: str,
                budget: int = PIECE_BYTES) -> list[Piece]:
    """Cut the shard into pieces of at most `budget` checkpoint bytes, packed in
    order (embedding, layers, head; at least one part each). Compressed
    precisions trace the embedding and the head alone: they are quantised per
    row to int8 by `compress_rows_int8`, the layers by NNCF (compress.py)."""
    parts: list[tuple[str, int, int]] = []  # (kind, layer, bytes)
    if start == 0:
        parts.append(("embed", -1, _stored_bytes(ckpt, "model.embed_tokens.")))
    parts += [("layer", i, _stored_bytes(ckpt, f"model.layers.{i}.")) for i in range(start, end)]
    if end == total:
        head = _stored_bytes(ckpt, "lm_head.") or _stored_bytes(ckpt, "model.embed_tokens.")  # tied
        parts.append(("head", -1, head))
    groups: list[list[tuple[str, int, int]]] = []
    compressed = precision in ("int8", "int4")
    for part in parts:
        alone = compressed and part[0] != "layer"
        last = groups[-1] if groups else None
        fits = last is not None and sum(p[2] for p in last) + part[2] <= budget
        if last is None or alone or not fits or (compressed and last[-1][0] != "layer"):
            groups.append([part])
        else:
            last.append(part)
    pieces = []
    for g in groups:
        layers = [p[1] for p in g if p[0] == "layer"]
        lo = layers[0] if layers else (end if g[0][0] == "head" else start)
        hi = layers[-1] + 1 if layers else lo
        pieces.append(Piece(g[0][0] == "embed", lo, hi, g[-1][0] == "head"))
    return pieces


def _piece_module(skeleton, piece: Piece):
    """A torch module tracing one Piece with the I/O of `_piece_io`."""
    import torch
    from torch import nn

    from engine.pipeline.shard_model import EmbedPiece, HeadPiece, LayerPiece

    class Traced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = EmbedPiece(skeleton) if piece.embed else None
            self.layers = nn.ModuleList(LayerPiece(skeleton, i) for i in range(piece.start, piece.end))
            self.head = HeadPiece(skeleton) if piece.head else None

        def forward(self, x, *rest):
            hidden = self.embed(x) if self.embed is not None else x
            presents = []
            if len(self.layers):
                mask, pos, rest = rest[0], rest[1], rest[2:]
                for j, layer in enumerate(self.layers):
                    hidden, k, v = layer(hidden, mask, pos, rest[2 * j], rest[2 * j + 1])
                    presents += [k, v]
                rest = rest[2 * len(self.layers):]
            if self.head is None:
                return (hidden, *presents)
            keep = rest[0][0]  # logits_to_keep: last `keep` positions; 0 = every position
            n = hidden.shape[1]
            c = torch.where(keep > 0, torch.minimum(keep, torch.tensor(n)), torch.tensor(n))
            hidden = hidden.index_select(1, torch.arange(n - c, n))  # [1, n, H] -> [1, c, H]
            logits = self.head(hidden)  # [1, c, V] f32
            return (logits, torch.argmax(logits, dim=-1), *presents)

    return Traced()


def _piece_io(piece: Piece, geo):
    """(example inputs, input specs, input names, output names) of a piece."""
    import openvino as ov
    import torch

    past_len, n = 2, 3  # shape-only example; every dim below is dynamic
    h_shape = ov.PartialShape([-1, -1, geo.hidden_size])
    if piece.embed:
        example, spec, ins = [torch.ones(1, n, dtype=torch.long)], [(ov.PartialShape([-1, -1]), ov.Type.i64)], ["input_ids"]
    else:
        example, spec, ins = [torch.zeros(1, n, geo.hidden_size)], [(h_shape, ov.Type.f32)], ["hidden_states"]
    outs = []
    layers = range(piece.start, piece.end)
    if len(layers):
        example += [torch.ones(1, past_len + n, dtype=torch.long),
                    torch.arange(past_len, past_len + n, dtype=torch.long)[None]]
        spec += [(ov.PartialShape([-1, -1]), ov.Type.i64)] * 2
        ins += ["attention_mask", "position_ids"]
        kv_shape = ov.PartialShape([-1, geo.num_kv_heads, -1, geo.head_dim])
        for i in layers:
            example += [torch.zeros(1, geo.num_kv_heads, past_len, geo.head_dim) for _ in range(2)]
            spec += [(kv_shape, ov.Type.f32)] * 2
            ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    if piece.head:
        example.append(torch.tensor([n], dtype=torch.long))
        spec.append((ov.PartialShape([1]), ov.Type.i64))
        ins.append("logits_to_keep")
        outs += ["logits", "next_token"]
    else:
        outs.append("hidden_states_out")
    for i in layers:
        outs += [f"present.{i}.key", f"present.{i}.value"]
    return tuple(example), spec, ins, outs


def _piece_owners(skeleton, piece: Piece) -> list[tuple[str, Any]]:
    """(checkpoint prefix, submodule) of every weight a piece reads."""
    base = skeleton.model
    owners = [("model.embed_tokens", base.embed_tokens)] if piece.embed else []
    owners += [(f"model.layers.{i}", base.layers[i]) for i in range(piece.start, piece.end)]
    if piece.head:
        owners += [("model.norm", base.norm), ("lm_head", skeleton.lm_head)]
    return owners


def _export_piece(skeleton, ckpt, piece: Piece, geo, precision: str, xml: Path) -> Path:
    """Load one piece's tensors, convert it, compress it, save it; free its weights."""
    import openvino as ov
    import torch

    from engine.models.checkpoint import release

    example, spec, names_in, names_out = _piece_io(piece, geo)
    owners = _piece_owners(skeleton, piece)
    weight_dtype = _trace_dtype(precision, ckpt.dtype())
    for prefix, module in owners:
        ckpt.load_into(module, prefix, dtype=weight_dtype)
    try:
        module = _piece_module(skeleton, piece).eval()
        if weight_dtype != torch.float32:
            from openvino.frontend.pytorch.patch_model import __make_16bit_traceable

            __make_16bit_traceable(module)
        with torch.no_grad():
            ov_model = ov.convert_model(module, example_input=example, input=spec)
        for port, name in zip(ov_model.inputs, names_in):
            port.get_tensor().set_names({name})
        for port, name in zip(ov_model.outputs, names_out):
            port.get_tensor().set_names({name})
        if precision in ("int8", "int4"):  # NNCF weight compression (engine/pipeline/compress.py)
            from engine.pipeline.compress import compress_piece

            kind = "embed" if piece.embed and piece.end == piece.start else \
                "head" if piece.head and piece.end == piece.start else "layers"
            ov_model = compress_piece(ov_model, precision, kind)
        # Saved before the torch weights go: the converted constants share their memory.
        ov.save_model(ov_model, str(xml), compress_to_fp16=False)
    finally:
        ov_model = module = None
        for _, owner in owners:
            release(owner)
    return xml


def _trace_dtype(precision: str, checkpoint_dtype):
    """Weight dtype a piece is traced with: the label's, or the checkpoint's for
    compressed labels (NNCF quantises from the stored 16-bit values)."""
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, checkpoint_dtype)


def _stitch(xmls: list[Path], labels: list[str]):
    """Chain the piece IRs into one model: a piece's hidden input reads the
    previous piece's output; every piece shares the first one's attention_mask
    and position_ids. Returns (model, past names, present names) in layer order."""
    import openvino as ov
    from openvino import opset13

    core = ov.Core()
    models = [core.read_model(str(x)) for x in xmls]  # weights memory-mapped
    params: dict[str, Any] = {}  # name -> the Parameter node the stitched model keeps
    past_names, present_names, presents, heads = [], [], [], []
    cur = None  # the previous piece's hidden output
    for label, m in zip(labels, models):
        for op in m.get_ops():  # distinct friendly names per piece
            op.set_friendly_name(f"{label}/{op.get_friendly_name()}")
        for port in m.inputs:
            name, node = port.get_any_name(), port.get_node()
            if name == "hidden_states" and cur is not None:
                node.output(0).replace(cur)
            elif name in params:
                node.output(0).replace(params[name].output(0))
            else:
                params[name] = node
                if name.startswith("past_key_values."):
                    past_names.append(name)
        for port in m.outputs:
            name = port.get_any_name()
            if name.startswith("present."):
                present_names.append(name)
                presents.append(port.get_node())
            elif name in ("logits", "next_token"):
                heads.append(port.get_node())
        if "hidden_states_out" in {n for o in m.outputs for n in o.get_names()}:
            cur = m.output("hidden_states_out").get_node().input_value(0)
            cur.get_tensor().set_names(set())  # internal unless it is the stage's output
    if heads:
        results = heads + presents
    else:
        cur.get_tensor().set_names({"hidden_states_out"})
        results = [opset13.result(cur)] + presents
    x = params.get("input_ids") or params["hidden_states"]
    order = [x, params["attention_mask"], params["position_ids"]] + [params[n] for n in past_names]
    if "logits_to_keep" in params:
        order.append(params["logits_to_keep"])
    model = ov.Model(results, order, "flotilla_shard")
    model.validate_nodes_and_infer_types()
    return model, past_names, present_names


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

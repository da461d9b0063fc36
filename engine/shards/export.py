"""Export a layer range [start, end) of a HF causal LM to a stateful OpenVINO shard.

Streaming: the exporter never holds the model. It builds the transformers
model with meta parameters (engine/models/checkpoint.py), then traces the
shard piece by piece — the embedding (first stage), each decoder layer, the
final norm + LM head (last stage) — loading only that piece's tensors from the
safetensors files in the checkpoint's dtype, converting it with OpenVINO
(16-bit weights stay 16-bit constants: `__make_16bit_traceable`), compressing
it (NNCF int8 / int4, engine/shards/compress.py) and saving it to a
temporary IR before the next piece loads. The pieces are then read back
(weights memory-mapped) and stitched into one graph, made stateful and saved.
Peak memory: about one piece in torch plus its converted copy, plus the
output shard being written (mapped, reclaimable file pages).

The KV cache is stateful (ReadValue/Assign) and, with `fuse_beam_idx=True`,
every past K/V is read through `Gather(ReadValue, beam_idx, 0)` before the
concat, which is the pattern the CPU plugin's `StatefulSDPAFusion` (GPU:
`IndirectKVCache`) folds into one SDPA-with-KV-cache node
(`shards.runtime.fused_sdpa_nodes` proves it on a compiled model). Without
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

The pieces (cutting, tracing, compressing) are in export_pieces.py, the
stitching, beam_idx and stateful KV in export_graph.py.
"""


from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from engine.models.fingerprint import model_fingerprint
from engine.shards.export_graph import _fuse_cache_reorder, _make_stateful, _ordered_states, _stitch
from engine.shards.export_pieces import _export_piece, plan_pieces

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
    # runtime holds twice (planner.memory.EXPERT_COPIES): the agent's start check adds them.
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


# This package's modules that decide a shard's graph and weights (not runtime.py, worker.py or
# health.py: running a shard does not change it).
_GRAPH_SOURCES = ("export.py", "export_pieces.py", "export_graph.py", "model.py", "moe.py", "pieces.py",
                  "compress.py")


def _exporter_digest() -> str:
    """Digest of the source that decides a shard's graph and weights (this
    exporter, the traced pieces, the compressor, the checkpoint reader), so
    editing any of it invalidates cached shards."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for f in [here / n for n in _GRAPH_SOURCES] + [here.parent / "planner" / "architectures.py",
                                                   here.parent / "models" / "checkpoint.py"]:
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
    from engine.shards.model import check_supported, geometry

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
    from engine.planner.model import PlanModel

    return int(sum(PlanModel.from_profile(profile_model(model_path)).expert_weight_bytes(precision)[start:end]))

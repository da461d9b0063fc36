"""The pieces a shard is exported in: cutting it by a byte budget, tracing, converting and compressing each.

export.export_shard loads one Piece's tensors at a time (_export_piece) and saves
it as its own IR; export_graph stitches those IRs into the shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    from engine.shards.model import EmbedPiece, HeadPiece, LayerPiece

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
        if precision in ("int8", "int4"):  # NNCF weight compression (engine/shards/compress.py)
            from engine.shards.compress import compress_piece

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

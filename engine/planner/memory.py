"""The planner's memory model: what a stage's weights, KV cache and worker cost in bytes.

Pure constants and functions (no I/O), shared by the planner (plan.py), the agent's
start check (engine/fleet/policy.py) and the benchmarks. docs/planner.md has the
measurements behind every number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise ValueError(why)


def _floats(obj: object, *names: str) -> None:
    """Store ints given for float fields as floats, so round trips compare equal."""
    for n in names:
        v = getattr(obj, n)
        if _is_int(v):
            object.__setattr__(obj, n, float(v))


# Weight precision labels, agreed across the team (exporter, planner, UI), most precise first.
PRECISIONS = ("f32", "bf16", "fp16", "int8", "int4")
AUTO = "auto"  # a request's "the most precise that fits" (choose_precision)
# Bytes per element of a weight matrix at each precision, before scales (see weight_bytes_of).
PRECISION_BYTES = {"f32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
# What "auto" tries for a checkpoint of each dtype, most precise first: its own dtype
# (never f32 for a half checkpoint: twice the bytes, no better), then int8, then int4.
# fp16 after f32 halves an f32 checkpoint at no real loss; fp16 after bf16 is the same
# size, so it cannot fit where bf16 does not.
PRECISION_LADDERS = {"f32": ("f32", "fp16", "int8", "int4"), "bf16": ("bf16", "int8", "int4"),
                     "fp16": ("fp16", "int8", "int4")}
# How engine/shards/compress.py (NNCF) stores compressed weights, read back from exported
# demo shards (Constant types and shapes of the IR):
#   int8  INT8_ASYM per output channel: u8 [out, in] + f16 scale [out, 1] + u8 zero point [out, 1]
#   int4  INT4_SYM, groups of 128 input channels: i4 [out, in/128, 128] + f16 scale [out, in/128, 1];
#         NNCF's backup mode keeps the embedding (Gather), the LM head and whatever MatMul ends
#         the shard's graph in int8 (a middle or first shard: its last layer's down projection)
#   f32/bf16/fp16 weights at 4/2/2 bytes; norm weights and biases stay f32 in the IR (tiny).
INT4_GROUP_SIZE = 128  # compress.INT4_GROUP_SIZE (a layer whose width is no multiple shrinks it: a few % more scales)
SCALE_BYTES = 2  # one f16 scale per int4 group / int8 output channel
ZERO_POINT_BYTES = 1  # one u8 zero point per int8 output channel (asymmetric)
VECTOR_BYTES = 4  # 1-D weights (norms, biases) in the IR


# ---------------------------------------------------------------- KV, reserves
# KV cache element type each device's plugin picks when the model does not say
# (the IR's rt_info runtime_options; our shards carry none, optimum-intel IRs say f16
# for unquantized models). Measured on this machine (OpenVINO 2026.4, AVX2 EPYC, no bf16):
# a compiled shard reports KV_CACHE_PRECISION u8 by default, f32 with our exact mode
# (INFERENCE_PRECISION_HINT=f32 + KV_CACHE_PRECISION=f32). GPU and NPU are f16 by their
# plugins' documented defaults (not measured here: no such device).
KV_DEFAULT_PRECISION = {"CPU": "u8", "GPU": "f16", "NPU": "f16"}
KV_PRECISION_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "u8": 1.0, "i8": 1.0}
# u8 KV keeps, per token, per head and for K and V alike, an f32 scale and an f32 zero
# point (KEY/VALUE_CACHE_GROUP_SIZE 0 = one group per head): 8 bytes per head_dim elements.
U8_KV_SCALE_BYTES = 8
DEFAULT_HEAD_DIM = 128  # when a model does not say (Llama, Qwen, Mistral)

# Runtime reserve of one worker: anonymous memory beyond its weights and KV. Measured with
# engine/bench/_reserve.py (docs/planner.md) on middle shards of 205 MB-822 MB: a fresh
# python + openvino (27 MB), the compiled shard and one 16-token inference hold 42-94 MB
# beyond the shard file, whatever the precision and size (the CPU plugin repacks the
# weights once: ~1.0 x the file, no part grows with them); the worker's own imports add 3 MB.
RUNTIME_RESERVE_BYTES = 100_000_000
RUNTIME_RESERVE_FRACTION = 0.0  # of the weights (measured ~0 beyond the 1.0 x copy)
# Memory that grows with the context, measured with KV sweeps (prefill in 512-token chunks
# to 4096 tokens, RssAnon per chunk; docs/planner.md) on two models that differ only in KV
# heads (16 vs 2), u8 and exact f32 KV; the model below predicts their peaks within -4..+10 %:
# - attention scores of a prefill chunk: SCORE_COPIES x f32 [heads, chunk, context]
#   (one prefill at a time per worker: not per stream);
# - u8 KV only: the past K and V of the layer being prefilled, dequantized to f32
#   (DEQUANT_COPIES x 2 x kv_heads x head_dim x 4 bytes per token of context);
# - u8 KV only: the cache grows by doubling and the replaced block stays resident, so
#   right after a doubling it holds up to KV_U8_GROWTH x its nominal size (f32 KV grew
#   smoothly: 4.0 bytes per element, no doubling jump);
# - the MLP's [chunk, intermediate] f32 activations (gate and up).
PREFILL_CHUNK = 512  # tokens per prefill call (the coordinator's prefill_chunk)
SCORE_COPIES = 1.5  # fitted 1.3 (u8 runs) and 1.5 (f32 runs): the larger
DEQUANT_COPIES = 1.25  # fitted on the u8 runs
KV_U8_GROWTH = 2.0
# Weights a device's runtime reads in place from the mapped shard file instead of copying
# them into its own memory. The token embedding is a Gather on a constant: the CPU plugin
# leaves that constant in the mmap'd IR, so only the rows of the tokens seen become
# resident, as page cache (reclaimable; a cgroup charges it but takes it back under its
# limit). Measured at Llama-3.1-8B shapes (docs/bench/scale): with nearly equal planned
# weights, the first stage's anonymous peak stayed below the last's by the embedding
# table's bytes at every precision (506 MiB at int4/int8, 1007 MiB at fp16), while every
# MatMul weight is repacked into anonymous memory (~1.0 x the file). GPU and NPU plugins copy
# weights to the device: counted there (not measured here).
EMBEDDING_MAPPED = {"CPU": True, "GPU": False, "NPU": False}
# Copies of the routed MoE experts' weights a device's runtime holds. The CPU plugin
# chooses a MatMul kernel by the tokens in the call and, for matrices this small, packs
# the weights differently for different batch sizes, keeping every packing it made. In a
# shard each routed expert is its own MatMul whose batch is the tokens routed to it, a
# different number every call, so a worker ends up holding its experts about twice.
# Measured with `flotilla bench shards --arch qwen3_moe` (docs/bench/shards-moe and
# shards-moe-a3b, Qwen3-30B-A3B's expert shape: each shard alone in a process, its
# anonymous memory after every call beside the plan). Dense MatMuls are counted once
# (Llamas of hidden 2048 and 4096 keep one copy under the same calls; a hidden-1024 one
# does not: docs/pipeline.md). GPU and NPU: 1 (not measured here).
EXPERT_COPIES = {"CPU": 2.0, "GPU": 1.0, "NPU": 1.0}
# OS reserve: RAM a peer leaves to its OS and owner on top of what is free now. Free
# RAM (MemAvailable) counts every reclaimable cache page as free; taking all of it
# evicts the code and files the desktop and the owner's idle programs need (they keep
# allocating while the PC is shared), and the shard's own IR file pages are read
# through that cache at load. 10 % of RAM, at least 1 GB: 1 GB on an 8 GB laptop,
# 3.2 GB on a 32 GB desktop.
OS_RESERVE_MIN_BYTES = 1_000_000_000
OS_RESERVE_FRACTION = 0.10


def check_precision(label: str, allow_auto: bool = False) -> str:
    """label if it is a precision label (or "auto" when allowed), else ValueError."""
    ok = label in PRECISION_BYTES or (allow_auto and label == AUTO)
    _need(ok, f"weight_precision must be {'auto or ' if allow_auto else ''}one of {', '.join(PRECISIONS)}")
    return label


def precision_ladder(checkpoint: str) -> tuple[str, ...]:
    """The precisions "auto" tries for a checkpoint of this dtype, most precise first."""
    return PRECISION_LADDERS.get(checkpoint, PRECISION_LADDERS["f32"])


def kv_element_bytes(device_kind: str, exact: bool = False, *, head_dim: int = DEFAULT_HEAD_DIM,
                     ir_precision: str | None = None) -> float:
    """Bytes one K or V element costs in the runtime's KV cache, its scales included.

    exact: the worker runs in exact mode (f32 KV). ir_precision: the IR's own
    runtime_options KV_CACHE_PRECISION ("f16", "u8"), which the plugin honours
    over its default; None for our shards."""
    if exact:
        return KV_PRECISION_BYTES["f32"]
    prec = ir_precision or KV_DEFAULT_PRECISION.get(device_kind, "f16")
    if prec in ("u8", "i8"):
        return 1.0 + U8_KV_SCALE_BYTES / max(1, head_dim)
    return KV_PRECISION_BYTES.get(prec, 4.0)


def os_reserve(ram_total_bytes: int) -> int:
    """What a peer with ram_total_bytes of RAM leaves to its OS and owner."""
    return max(OS_RESERVE_MIN_BYTES, math.ceil(OS_RESERVE_FRACTION * max(0, ram_total_bytes)))


def prefill_scratch(num_heads: int, intermediate: int, context_length: int,
                    chunk: int = PREFILL_CHUNK, dequant_kv_elements: int = 0) -> int:
    """Activations of one prefill chunk at the end of the context, bytes: attention scores,
    the MLP's intermediates and (u8 KV) one layer's past K + V dequantized to f32
    (dequant_kv_elements = K + V elements per token of that layer)."""
    c = min(chunk, context_length)
    scores = SCORE_COPIES * num_heads * c * context_length
    return math.ceil(4 * (scores + 2 * c * intermediate + DEQUANT_COPIES * dequant_kv_elements * context_length))


def kv_growth(device_kind: str, exact: bool = False) -> float:
    """Peak KV memory / its nominal size (u8 CPU cache: grows by doubling)."""
    return KV_U8_GROWTH if not exact and KV_DEFAULT_PRECISION.get(device_kind) == "u8" else 1.0

@dataclass(frozen=True)
class WeightCounts:
    """Parameters of some weight tensors, by how the exporter stores them."""

    matrix: int = 0  # elements of 2-D+ tensors (Linear weights, embedding tables): int8/int4 compress these
    rows: int = 0  # their output channels: int8 keeps one scale + zero point per row
    vector: int = 0  # elements of 1-D tensors (norm weights, biases): f32 in the IR

    def __post_init__(self) -> None:
        for n in ("matrix", "rows", "vector"):
            _need(_is_int(getattr(self, n)) and getattr(self, n) >= 0, f"weight count {n} must be an int >= 0")

    @classmethod
    def of(cls, v: Any) -> WeightCounts:
        """From a WeightCounts, a ModelProfile ParamCounts or their dict."""
        if isinstance(v, WeightCounts):
            return v
        get = v.get if isinstance(v, Mapping) else (lambda k, d=0: getattr(v, k, d))
        return cls(int(get("matrix", 0)), int(get("rows", 0)), int(get("vector", 0)))


def weight_bytes_of(counts: WeightCounts, precision: str, int8_backup: bool = False) -> int:
    """Bytes of these weights in an IR at precision (int8_backup: int4's int8 exceptions)."""
    m = counts.matrix
    if precision == "int4" and not int8_backup:
        mat = m * PRECISION_BYTES["int4"] + SCALE_BYTES * math.ceil(m / INT4_GROUP_SIZE)
    elif precision in ("int8", "int4"):
        mat = m * PRECISION_BYTES["int8"] + (SCALE_BYTES + ZERO_POINT_BYTES) * counts.rows
    else:
        mat = m * PRECISION_BYTES[precision]
    return math.ceil(mat + VECTOR_BYTES * counts.vector)


def embedding_table_bytes(vocab_size: int, hidden_size: int, precision: str) -> int:
    """Bytes of a [vocab, hidden] token embedding in a shard at precision (int4 keeps it int8)."""
    return weight_bytes_of(WeightCounts(matrix=vocab_size * hidden_size, rows=vocab_size), precision,
                           int8_backup=True)


def embedding_mapped(device_kind: str) -> bool:
    """The device's runtime reads the embedding from the mapped file (see EMBEDDING_MAPPED)."""
    return EMBEDDING_MAPPED.get(device_kind, False)


def expert_copies(device_kind: str) -> float:
    """Copies of the routed experts' weights the device's runtime holds (see EXPERT_COPIES)."""
    return EXPERT_COPIES.get(device_kind, 1.0)

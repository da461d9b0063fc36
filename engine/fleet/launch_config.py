"""LaunchConfig: what a fleet launch is asked for (model, stages, precision, timeouts, recovery)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.planner.plan import DEFAULT_PREFERENCE


@dataclass(frozen=True)
class LaunchConfig:
    model: str = "demo"  # model spec: demo id, HF folder or hub id
    stages: int | None = None  # None = auto_plan chooses; k = even split over the k roomiest peers
    exact: bool = False  # f32 inference + KV cache on every stage (matches transformers)
    # Shard weight precision when the launcher plans: "auto" = the most precise at which the plan fits
    # (from the checkpoint's own dtype down), or "f32" | "bf16" | "fp16" | "int8" | "int4". With a user
    # plan it must be "auto" or that plan's own precision (the plan decides).
    weights: str = "auto"
    context_length: int | None = None  # tokens per stream (KV sizing); None = the model's own; a user plan's wins
    max_concurrent: int = 4  # streams in the ring at once (KV reserved for each on every stage); a user plan's wins
    prefill_chunk: int = 512  # prompt tokens per step
    # follow-ups reuse whole prefill chunks only and the workers keep a 16-bit KV cache
    # (engine/pipeline/prompt_cache.py): a cached answer is the uncached one, greedy
    prompt_cache_exact: bool = False
    device_preference: tuple[str, ...] = DEFAULT_PREFERENCE  # device kinds, best first
    controller_host: str | None = None  # address stages dial back; None = ours toward the first peer
    ready_timeout_s: float = 180.0  # every stage loaded and wired within this
    load_timeout_s: float = 90.0  # one agent's Load (its worker's start) within this
    chunk_bytes: int = 1024 * 1024  # shard transfer chunk
    recover: bool = True  # a lost or yielding stage is re-planned onto another agent (or this PC)
    local_fallback: bool = True  # recovery may run a lost stage on this PC when no agent can

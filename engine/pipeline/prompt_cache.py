"""Prompt caching across the pipeline: finished streams stay parked on every stage.

When an answer ends, its stream is not freed at once: every stage keeps its KV, and the
coordinator keeps the ids it holds. A new request whose prompt shares a long enough
prefix with a parked stream (engine/runtime/prompt_cache.py) takes that stream over: its
first step hides what the stages hold past the shared prefix and compacts it away (the
same step fields speculative rollback uses), then prefills only the rest.

With PipelineConfig.prompt_cache_exact a take-over keeps only whole prefill chunks that
were computed as a fresh prefill computes them (`grid`, engine/runtime/prompt_cache.py),
and the stages keep a 16-bit KV cache, so the compaction's read-back and rewrite is
lossless (a u8 cache is re-quantized by it; the local runner and the fleet session start
the workers with EXACT_CACHE_KV): the cached answer is then the uncached one at any precision, for up to one chunk of
prefill more. A stream's `exact` ids are those: its prompt's whole chunks.

Parked streams hold KV on every stage like running ones, so they count against the
plan's streams (max_concurrent): the coordinator parks at most `capacity` and gives
their room back before a new request would exceed max_concurrent. Pure bookkeeping: the
coordinator sends the frees this returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.runtime.prompt_cache import best_reuse

# The exact prompt cache's KV cache: a take-over reads the kept KV back and writes it again,
# lossless at 16 bits (by hand: a u8 cache is re-quantized and its logits move).
EXACT_CACHE_KV = "f16"


def stage_kv_precision(prompt_cache_exact: bool, exact: bool = False) -> str:
    """The KV cache precision a launch asks its stages for: the exact prompt cache's, or ""
    (the devices' defaults; exact mode's f32 KV comes with the worker's --exact)."""
    return EXACT_CACHE_KV if prompt_cache_exact and not exact else ""


def planned_kv_bytes(kv_precision: str) -> float | None:
    """Bytes of a KV element at a stage's kv_precision, as the planner counts it
    (PlanRequest.kv_dtype_bytes); None: the devices' defaults."""
    from engine.planner.memory import kv_element_bytes

    return kv_element_bytes("CPU", ir_precision=kv_precision) if kv_precision else None


@dataclass(frozen=True)
class Parked:
    stream_id: str
    seq: int  # the stream's next step number on every stage
    past: int  # tokens physically in its KV state on every stage
    ids: tuple[int, ...]  # those tokens, in order
    exact: int = 0  # of them, the leading ones prefilled in whole chunks of the prefill grid


class ParkedStreams:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._parked: OrderedDict[str, Parked] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, stream: Parked) -> list[str]:
        """Keep a finished stream; returns the stream ids to free (the oldest over capacity,
        or this one when nothing may be kept)."""
        if self.capacity == 0:
            return [stream.stream_id]
        self._parked[stream.stream_id] = stream
        return self.evict(len(self._parked) - self.capacity)

    def take(self, prompt_ids: Sequence[int], grid: int = 1) -> tuple[Parked, int] | None:
        """The parked stream to start `prompt_ids` from and how many of its ids to keep
        (grid > 1: whole chunks of that many ids, computed on that grid)."""
        parked = list(self._parked.values())
        held = [p.ids if grid <= 1 else p.ids[:p.exact] for p in parked]
        best, keep = best_reuse(held, prompt_ids, grid)
        if best is None:
            return None
        del self._parked[parked[best].stream_id]
        return parked[best], keep

    def evict(self, n: int) -> list[str]:
        """Give up the n oldest parked streams; their ids, to free on every stage."""
        out = []
        while n > 0 and self._parked:
            out.append(self._parked.popitem(last=False)[0])
            n -= 1
        return out

    def clear(self) -> list[str]:
        return self.evict(len(self._parked))

"""The planner's output: a Plan, its Stages in ring order, with their predicted memory and speed."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from engine.planner.json_form import _from_dict, _tuple_of
from engine.planner.memory import _floats, _is_int, _is_num, _need, check_precision
from engine.planner.search import StageSpec


@dataclass(frozen=True)
class Stage:
    peer_id: str  # peer that runs it
    device: str  # device name on that peer ("GPU.0")
    start: int  # first layer (inclusive)
    end: int  # last layer + 1 (exclusive)
    weight_bytes: int  # its layers (+ embeddings if first, + head if last) at the precision: the shard
    kv_bytes: int  # KV for context_length * streams tokens over its layers, at the runtime's KV width
    runtime_reserve_bytes: int  # the worker's own memory: fixed part + prefill activations
    os_reserve_bytes: int  # left to the peer's OS and owner
    total_bytes: int  # weight + kv + runtime + OS reserve
    ram_free_bytes: int  # what the peer shares: min(free RAM, its policy cap)
    fits: bool  # total_bytes <= ram_free_bytes
    compute_ms: float  # predicted compute per token
    hop_ms: float  # predicted outgoing transfer per token
    predicted_ms_per_token: float  # compute + hop
    predicted_tok_s: float  # 1000 / predicted_ms_per_token: the stage's own cap
    # The part of weight_bytes the device reads in place from the mapped shard file (a CPU
    # stage 0's embedding table, planner.memory.EMBEDDING_MAPPED): on disk, not in total_bytes.
    mapped_bytes: int = 0

    def __post_init__(self) -> None:
        _need(isinstance(self.peer_id, str) and isinstance(self.device, str), "bad stage peer/device")
        for n in ("start", "end", "weight_bytes", "kv_bytes", "runtime_reserve_bytes", "os_reserve_bytes",
                  "total_bytes", "ram_free_bytes", "mapped_bytes"):
            _need(_is_int(getattr(self, n)), f"stage {n} must be an int")
        _need(isinstance(self.fits, bool), "stage fits must be a bool")
        for n in ("compute_ms", "hop_ms", "predicted_ms_per_token", "predicted_tok_s"):
            _need(_is_num(getattr(self, n)), f"stage {n} must be a number")
        _floats(self, "compute_ms", "hop_ms", "predicted_ms_per_token", "predicted_tok_s")

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def margin_bytes(self) -> int:
        """Both reserves (runtime + OS): the memory bar's third segment."""
        return self.runtime_reserve_bytes + self.os_reserve_bytes

    @property
    def resident_weight_bytes(self) -> int:
        """Weights the worker holds in its own memory: the shard but what stays mapped."""
        return self.weight_bytes - self.mapped_bytes

    @property
    def process_bytes(self) -> int:
        """The worker process's predicted peak (anonymous memory): resident weights + KV + runtime reserve."""
        return self.resident_weight_bytes + self.kv_bytes + self.runtime_reserve_bytes

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.total_bytes - self.ram_free_bytes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class Plan:
    model_id: str  # the model it partitions
    stages: tuple[Stage, ...]  # in ring order; stage 0 holds embeddings, the last the head
    weight_precision: str  # the concrete precision the shards are exported at ("auto" resolved)
    context_length: int  # tokens of KV reserved per stream
    streams: int  # concurrent streams the KV was sized for
    bottleneck_ms: float  # max stage time per token
    cycle_ms: float  # sum of stage times: one token of one stream around the ring
    predicted_tok_s: float  # single stream: 1000 / cycle_ms
    predicted_aggregate_tok_s: float  # min(streams * 1000 / cycle, 1000 / bottleneck)
    fits: bool  # every stage fits its peer
    exact: bool = False  # workers run exact (f32 math + KV): what the KV was sized at

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        _need(all(isinstance(s, Stage) for s in self.stages), "plan stages must be Stage")
        check_precision(self.weight_precision)
        _floats(self, "bottleneck_ms", "cycle_ms", "predicted_tok_s", "predicted_aggregate_tok_s")

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(s.peer_id for s in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Layer where each stage after the first starts."""
        return tuple(s.start for s in self.stages[1:])

    def to_dict(self) -> dict:
        return {**asdict(self), "stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        return _from_dict(cls, d, stages=_tuple_of(Stage.from_dict))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def stage_specs(plan_or_stages: Any) -> list[StageSpec]:
    """(peer_id, device, start, end) of a Plan, Stages, dicts or 4-tuples."""
    items = plan_or_stages.stages if isinstance(plan_or_stages, Plan) else plan_or_stages
    out = []
    for it in items or ():
        if isinstance(it, Stage):
            out.append((it.peer_id, it.device, it.start, it.end))
        elif isinstance(it, Mapping):
            out.append((it.get("peer_id"), it.get("device"), it.get("start"), it.get("end")))
        else:
            out.append(tuple(it))
    return out

"""PlanRequest: what a plan is asked to hold (context, streams, precision, reserves)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

from engine.planner.json_form import _from_dict
from engine.planner.memory import (
    AUTO, PREFILL_CHUNK, RUNTIME_RESERVE_BYTES, RUNTIME_RESERVE_FRACTION, _floats, _is_int, _is_num, _need,
    check_precision)

if TYPE_CHECKING:
    from engine.planner.model import PlanModel


@dataclass(frozen=True)
class PlanRequest:
    # tokens of KV reserved per stream; None = DEFAULT_CONTEXT clipped to the model's maximum
    context_length: int | None = None
    streams: int = 1  # concurrent streams; each keeps its own KV on every stage
    kv_dtype_bytes: float | None = None  # bytes per KV element; None = kv_element_bytes(device, exact)
    weight_precision: str = AUTO  # "auto" (choose_precision) or a PRECISIONS label
    exact: bool = False  # workers run exact (f32 math + f32 KV cache, LoadRequest.exact)
    runtime_reserve_bytes: int = RUNTIME_RESERVE_BYTES  # measured fixed memory of a worker
    runtime_reserve_fraction: float = RUNTIME_RESERVE_FRACTION  # + this fraction of its weights
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill call (sizes its activations); 0 = none
    os_reserve_bytes: int | None = None  # left to each peer's OS; None = os_reserve(the peer's RAM)

    def __post_init__(self) -> None:
        _need(self.context_length is None or (_is_int(self.context_length) and self.context_length >= 1),
              "context_length must be >= 1 or null")
        _need(_is_int(self.streams) and self.streams >= 1, "streams must be >= 1")
        _need(self.kv_dtype_bytes is None or (_is_num(self.kv_dtype_bytes) and self.kv_dtype_bytes > 0),
              "kv_dtype_bytes must be > 0 or null")
        _need(isinstance(self.exact, bool), "exact must be a bool")
        _need(_is_int(self.runtime_reserve_bytes) and self.runtime_reserve_bytes >= 0,
              "runtime_reserve_bytes must be >= 0")
        _need(_is_num(self.runtime_reserve_fraction) and 0 <= self.runtime_reserve_fraction < 1,
              "runtime_reserve_fraction must be in [0, 1)")
        _need(_is_int(self.prefill_chunk) and self.prefill_chunk >= 0, "prefill_chunk must be >= 0")
        _need(self.os_reserve_bytes is None or (_is_int(self.os_reserve_bytes) and self.os_reserve_bytes >= 0),
              "os_reserve_bytes must be >= 0 or null")
        check_precision(self.weight_precision, allow_auto=True)
        _floats(self, "kv_dtype_bytes", "runtime_reserve_fraction")

    def context_for(self, model: PlanModel) -> int:
        """The context this request sizes KV for on model."""
        if self.context_length is not None:
            return self.context_length
        from engine.models.profile import default_context

        return default_context(model.max_context)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanRequest:
        return _from_dict(cls, d)

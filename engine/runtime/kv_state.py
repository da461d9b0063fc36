"""Mask-based KV rollback: which physical KV positions of a stream are visible.

A stateful OpenVINO model appends every token it runs to its KV state. When a
speculative step's drafts are rejected, their K/V stay in the state and are
*hidden*: the attention_mask is 0 at their physical positions, and the next
tokens take position_ids that follow the logical length (the visible tokens),
not the physical one. Rotary embeddings are applied at logical positions when
K is written, so the visible K/V are exactly those of a stream that never saw
the drafts; only summation order inside SDPA may differ (~1e-6).

`VisibleMask` is that bookkeeping for one stream (used by the pipeline
workers, the local speculative stream and the draft model). `compact_state`
physically drops the hidden positions (query_state -> gather -> set state),
which costs a copy of the whole KV state, so it is done only when the hidden
fraction crosses a threshold (engine/speculative/config.py). `trim_state`
is the classic physical rollback (drop the tail), kept for the benchmark.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


class VisibleMask:
    """Physical KV length of one stream and a visibility bit per position."""

    def __init__(self, capacity: int = 512) -> None:
        self._buf = np.ones(max(16, capacity), np.int64)  # 1 visible, 0 hidden; [capacity]
        self.length = 0  # physical positions in the KV state
        self.hidden = 0  # of which hidden

    def reset(self) -> None:
        self._buf[:self.length] = 1
        self.length = self.hidden = 0

    @property
    def visible(self) -> int:
        """The logical length: position_ids of the next token."""
        return self.length - self.hidden

    @property
    def hidden_fraction(self) -> float:
        return self.hidden / self.length if self.length else 0.0

    def hide(self, start: int, end: int) -> None:
        """Hide physical positions [start, end) (already hidden ones are fine)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"cannot hide [{start}, {end}) of {self.length} positions")
        part = self._buf[start:end]
        self.hidden += int(part.sum())
        part[:] = 0

    def hide_ranges(self, flat: Iterable[int]) -> None:
        it = iter(flat)
        for a, b in zip(it, it):
            self.hide(a, b)

    def hide_tail(self, count: int) -> None:
        """Hide the last `count` physical positions (rejected drafts of the last step)."""
        if count:
            self.hide(self.length - count, self.length)

    def feed(self, n: int) -> np.ndarray:
        """attention_mask int64 [1, length + n] for a step of n new (visible) tokens.

        A view of the internal buffer: valid until the next change."""
        need = self.length + n
        if need > self._buf.shape[0]:
            grown = np.ones(max(need, 2 * self._buf.shape[0]), np.int64)
            grown[:self.length] = self._buf[:self.length]
            self._buf = grown
        return self._buf[:need][None]  # [1, length + n], contiguous

    def positions(self, n: int) -> np.ndarray:
        """position_ids int64 [1, n] of the next n tokens (logical)."""
        return np.arange(self.visible, self.visible + n, dtype=np.int64)[None]

    def commit(self, n: int) -> None:
        """n tokens were appended to the state (all visible)."""
        self.feed(n)
        self.length += n

    def keep_index(self) -> np.ndarray:
        """Physical indices of the visible positions, ascending (int64 [visible])."""
        return np.flatnonzero(self._buf[:self.length])

    def compacted(self) -> None:
        """The state now holds only the visible positions."""
        self._buf[:self.length] = 1
        self.length -= self.hidden
        self.hidden = 0


def compact_state(request: Any, keep: np.ndarray) -> None:
    """Keep only positions `keep` (axis 2) of every KV state of an InferRequest."""
    import openvino as ov

    for state in request.query_state():
        data = state.state.data  # [batch, kv_heads, T, head_dim]
        state.state = ov.Tensor(np.ascontiguousarray(np.take(data, keep, axis=2)))


def trim_state(request: Any, length: int) -> None:
    """Physical rollback: keep the first `length` positions of every KV state."""
    import openvino as ov

    for state in request.query_state():
        data = state.state.data  # [batch, kv_heads, T, head_dim]
        state.state = ov.Tensor(np.ascontiguousarray(data[:, :, :length]))


def state_bytes(request: Any) -> int:
    """Bytes of every KV state of an InferRequest (as read back)."""
    return sum(int(s.state.data.nbytes) for s in request.query_state())

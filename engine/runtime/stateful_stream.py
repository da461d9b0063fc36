"""One request's KV state on a stateful OpenVINO model, and the one way to append to it.

Every stateful IR here (optimum-intel's whole model, a pipeline shard, a draft model)
takes the same inputs around what a step feeds it: attention_mask over every physical
KV position (0 where a position is hidden), position_ids at the logical positions,
and beam_idx. StatefulStream adds them, runs the step and records what the state now
holds (engine/runtime/kv_state.py's VisibleMask), so the local engine's streams, the
speculative stream, the draft model and the pipeline worker do not each build the feed:

    stream = StatefulStream(compiled.create_infer_request(), input_names)
    stream.infer({"input_ids": ids}, n)          # ids: [1, n]
    stream.hide_tail(2)                          # two rejected drafts: masked, not recomputed
    stream.compact_if(fraction=0.33, min_hidden=64)

A stream that never hides (the plain local stream) feeds an all-ones mask: the same
inputs as before the visibility mask existed.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from engine.runtime.kv_state import VisibleMask, compact_state, trim_state


class StatefulStream:
    def __init__(self, request: Any, input_names: Iterable[str]) -> None:
        self.request = request
        self.names = set(input_names)
        self.mask = VisibleMask()
        self.compactions = 0

    @property
    def visible(self) -> int:
        """Tokens the model sees: the logical length, position_ids of the next token."""
        return self.mask.visible

    @property
    def length(self) -> int:
        """Positions physically in the KV state (visible or hidden)."""
        return self.mask.length

    def feed(self, inputs: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """inputs (input_ids or hidden_states, logits_to_keep...) plus the state's own inputs
        for a step of n new tokens."""
        feed = dict(inputs)
        if "attention_mask" in self.names:
            feed["attention_mask"] = self.mask.feed(n)  # [1, length + n], 0 at hidden positions
        if "position_ids" in self.names:
            feed["position_ids"] = self.mask.positions(n)  # [1, n], logical
        if "beam_idx" in self.names and "beam_idx" not in feed:
            feed["beam_idx"] = np.zeros(1, np.int32)  # one sequence: no reordering
        return feed

    def infer(self, inputs: Mapping[str, np.ndarray], n: int, **infer_kw: Any) -> None:
        """Run one step of n new (visible) tokens; read the outputs from self.request."""
        self.request.infer(self.feed(inputs, n), **infer_kw)
        self.mask.commit(n)

    def hide_tail(self, count: int) -> None:
        """Roll back the last `count` positions (rejected drafts): hidden by the mask."""
        self.mask.hide_tail(count)

    def hide_ranges(self, flat: Iterable[int]) -> None:
        """Hide physical [start, end) ranges, flattened."""
        self.mask.hide_ranges(flat)

    def compact(self) -> None:
        """Drop every hidden position from the state (a copy of the whole state)."""
        compact_state(self.request, self.mask.keep_index())  # every state: [1, kv, visible, d]
        self.mask.compacted()
        self.compactions += 1

    def compact_if(self, fraction: float, min_hidden: int) -> bool:
        """Compact when enough is hidden to pay for the copy; whether it did."""
        if self.mask.hidden >= min_hidden and self.mask.hidden_fraction >= fraction:
            self.compact()
            return True
        return False

    def keep_first(self, count: int) -> None:
        """Keep the first `count` positions of a state with nothing hidden (a reused prompt
        prefix); 0 empties it. Raises what trimming raises (e.g. a state numpy cannot hold)."""
        if count <= 0:
            self.reset()
            return
        if count < self.mask.length:
            trim_state(self.request, count)  # [batch, kv_heads, T, head_dim] -> first `count` positions
        self.mask.reset()
        self.mask.commit(count)

    def reset(self) -> None:
        """An empty state."""
        self.request.reset_state()
        self.mask.reset()

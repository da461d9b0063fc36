"""Running exported shards: compile one, one InferRequest + KV state per stream.

`ShardRunner` compiles a shard (see `export.py` for its I/O); `ShardStream` is
one user's request and state on it. `fused_sdpa_nodes` proves on a compiled
model that the stateful SDPA-with-KV-cache fusion fired.

Memory: a shard's weights are held once. The compile settings come from
engine.runtime.ov_compile.compile_config, the same function the local engine
uses: on CPU the shard is compiled straight from its IR, whose .bin OpenVINO
maps (no CACHE_DIR blob: importing one doubled the anonymous memory and saved
no time); `cache_dir` is used only on devices where compiling is slow (GPU/NPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from engine.runtime.stateful_stream import StatefulStream

from engine.shards.export import ShardInfo


# -- fusion check ------------------------------------------------------------


def _layer_type(node) -> str:
    info = node.get_rt_info()
    return info["layerType"].astype(str) if "layerType" in info else node.get_type_name()


def fused_sdpa_nodes(compiled) -> list[str]:
    """Names of runtime SDPA nodes that read the KV state directly (fused KV cache).

    CPU: StatefulSDPAFusion turns ReadValue -> Gather(beam_idx) -> Concat ->
    SDPA into one "ScaledDotProductAttention" node whose inputs include the
    "MemoryInput" state nodes. GPU: the fused kernel is expected to show up as
    an "IndirectSDPA" layer type (not verified on hardware here).
    """
    names = []
    for node in compiled.get_runtime_model().get_ops():
        kind = _layer_type(node)
        if kind in ("IndirectSDPA", "indirect_sdpa"):
            names.append(node.get_friendly_name())
            continue
        if kind != "ScaledDotProductAttention":
            continue
        sources = {_layer_type(i.get_source_output().get_node()) for i in node.inputs()}
        if "MemoryInput" in sources:
            names.append(node.get_friendly_name())
    return names


def runtime_op_counts(compiled) -> dict[str, int]:
    """layerType -> count of a compiled model's runtime graph (for reports)."""
    counts: dict[str, int] = {}
    for node in compiled.get_runtime_model().get_ops():
        kind = _layer_type(node)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# -- running -----------------------------------------------------------------


class ShardStream:
    """One user's InferRequest and KV state on one shard (a StatefulStream)."""

    def __init__(self, runner: "ShardRunner"):
        self.runner = runner
        self.state = StatefulStream(runner.compiled.create_infer_request(), runner.input_names)
        self.request = self.state.request
        self.reset()

    def reset(self) -> None:
        """Empty KV cache: every state set to [1, kv_heads, 0, head_dim]."""
        import openvino as ov

        info = self.runner.info
        self.state.reset()
        empty = np.zeros((1, info.num_kv_heads, 0, info.head_dim), np.float32)
        for state in self.request.query_state():
            state.state = ov.Tensor(empty)

    def _complete(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = dict(inputs)
        if "beam_idx" in self.runner.input_names and "beam_idx" not in feed:
            some = next(iter(feed.values()))
            feed["beam_idx"] = np.zeros(some.shape[0], np.int32)
        if "logits_to_keep" in self.runner.input_names and "logits_to_keep" not in feed:
            feed["logits_to_keep"] = np.zeros(1, np.int64)  # not asked: logits of every position
        return feed

    def _outputs(self) -> dict[str, np.ndarray]:
        # copied once here: the next infer() overwrites them
        return {name: self.request.get_tensor(port).data.copy() for name, port in self.runner.output_ports.items()}

    def step(self, inputs: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """Append n tokens (input_ids or hidden_states [1, n, ...]): the stream adds the
        attention_mask over its visible positions and the logical position_ids."""
        # Shared in/out buffers skip two copies per call.
        self.state.infer(self._complete(inputs), n, share_inputs=True, share_outputs=True)
        return self._outputs()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a feed as given (the caller's own attention_mask and position_ids): benchmarks
        and references that drive a shard directly."""
        self.request.infer(self._complete(inputs), share_inputs=True, share_outputs=True)
        return self._outputs()


class ShardRunner:
    """A compiled shard; `new_stream()` gives each user its own request + state.

    exact: f32 math and f32 KV cache; cache_dir: blob cache where it pays (not CPU);
    config: extra compile properties (e.g. INFERENCE_NUM_THREADS), applied last."""

    def __init__(self, info: ShardInfo | Path, device: str = "CPU", *, exact: bool = False,
                 cache_dir: Path | None = None, core: Any = None, config: dict | None = None):
        import openvino as ov

        from engine.runtime.ov_compile import compile_config

        self.info = info if isinstance(info, ShardInfo) else ShardInfo.load(Path(info))
        self.core = core or ov.Core()
        # exact: bit-comparable with torch f32 (no bf16/fp16 compute, f32 KV cache)
        extra = dict(config or {})
        threads = extra.pop("INFERENCE_NUM_THREADS", None)  # compile_config knows what one thread needs
        cfg: dict[str, Any] = compile_config(device, "f32" if exact else "default", cache_dir, threads)
        cfg.update(extra)
        self.compiled = self.core.compile_model(str(self.info.xml), device, cfg)
        self.input_names = [p.get_any_name() for p in self.compiled.inputs]
        self.output_ports = {p.get_any_name(): p for p in self.compiled.outputs}

    def new_stream(self) -> ShardStream:
        return ShardStream(self)

    def fused_sdpa_nodes(self) -> list[str]:
        return fused_sdpa_nodes(self.compiled)

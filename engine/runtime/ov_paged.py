"""One OpenVINO model run over a paged KV cache: many sequences, one forward pass.

The exported (stateful) IR is rewritten with OpenVINO's own paged-attention
transformation -- the one openvino_genai's continuous batching runs on: the KV
state becomes per-layer `key_cache.N`/`value_cache.N` inputs holding fixed-size
blocks, and each call is told which tokens of which sequence it gets
(`subsequence_begins`), how much each sequence already holds (`past_lens`) and
which blocks are its (`block_indices`, `block_indices_begins`). So one infer()
can prefill one prompt's chunk and advance every other sequence by a token at
once. A `sampled_tokens_indices` input (a Gather before the LM head) asks for
the logits rows the caller will pick from, one per sequence that needs one,
where the plain model would compute a row per token fed.

The cache tensors are allocated once (allocate(blocks)); their element type and
block layout are the plugin's (CPU: 32 positions per block; bf16, f16, u8 with its
scales, or f32 under precision "f32") and are read off the compiled model. Pages
of the tensors are only resident once written, so the pool's size is a ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from engine.runtime.backend import Progress
from engine.runtime.errors import BackendError
from engine.runtime.ov_backend import IR_NAME, check_device, compile_config, ensure_ir, ov_cache_root
from engine.runtime.ov_logits import find_lm_head

class PagedUnsupported(BackendError):
    """The model has no paged form here (its attention, or its LM head, was not found)."""


SAMPLED = "sampled_tokens_indices"  # the rows of the flat batch whose logits are computed


@dataclass
class SeqWork:
    """One sequence's part of a forward pass."""

    ids: Sequence[int]  # tokens to append to its KV
    past: int  # tokens its KV holds before them
    blocks: Sequence[int]  # its block table (covers past + len(ids) positions)
    logits: int  # how many of the last ids need their logits rows (0, 1, or all of a verify step)


def add_sampled_indices(model: Any) -> None:
    """Gather the rows named by `sampled_tokens_indices` before the LM head (in place)."""
    import openvino as ov
    import openvino.opset13 as ops

    matmul = find_lm_head(model)
    if matmul is None:
        raise PagedUnsupported("the model has no LM head MatMul before its logits; it cannot run paged")
    rows = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name=SAMPLED)
    rows.output(0).get_tensor().set_names({SAMPLED})
    hidden = matmul.input_value(0)  # [tokens, 1, H] after the paged transformation
    picked = ops.gather(hidden, rows, ops.constant(np.array(0, dtype=np.int64)))  # [rows, 1, H]
    matmul.input(0).replace_source_output(picked.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()


class PagedModel:
    """A compiled paged model and its KV cache tensors."""

    def __init__(self, source: Path, device: str = "CPU", precision: str = "default",
                 progress: Progress | None = None) -> None:
        import openvino as ov
        from openvino._offline_transformations import paged_attention_transformation

        report = progress or (lambda _m, _f: None)
        core = ov.Core()
        self.device = check_device(core, device)
        root = ov_cache_root()
        self.model_dir = ensure_ir(Path(source), root, report)
        report(f"compiling for {self.device} (paged KV cache)", 0.7)
        try:
            model = core.read_model(str(self.model_dir / IR_NAME))
            paged_attention_transformation(model)
            add_sampled_indices(model)
            self.compiled = core.compile_model(model, self.device, compile_config(self.device, precision, None))
            del model
        except BackendError:
            raise
        except Exception as e:
            raise PagedUnsupported(f"compiling {self.model_dir.name} for {self.device} with a paged KV cache "
                                   f"failed: {e}") from e
        self.request = self.compiled.create_infer_request()
        caches = [i for i in self.compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]
        if not caches:
            raise PagedUnsupported(f"{self.model_dir.name} has no attention the paged transformation could take")
        shapes = {i.get_any_name(): [d.get_length() for d in list(i.get_partial_shape())[1:]] for i in caches}
        self.block_size = shapes["value_cache.0"][1]  # value_cache: [blocks, kv heads, block size, head (+ scales)]
        # u4 packs two per byte but its size() is 1: the figure is then a ceiling
        self.block_bytes = sum(int(np.prod(shapes[i.get_any_name()])) * i.get_element_type().size for i in caches)
        self._caches = [(i.get_any_name(), i.get_element_type(), shapes[i.get_any_name()]) for i in caches]
        self.blocks = 0  # until allocate()
        # the inputs start() sets, and the tensors' memory the request reads them from (_set_inputs)
        self._ports = {name: i for i in self.compiled.inputs for name in i.get_names()}
        self._held: dict[str, np.ndarray] = {}
        self._running = False  # a pass was started and not waited for
        self.vocab = int(self.compiled.output(0).get_partial_shape()[-1].get_length())
        report("model ready", 1.0)

    def allocate(self, blocks: int) -> None:
        """The KV pool: `blocks` blocks in every layer's cache tensors (a page is resident
        once written, so this is the pool's ceiling, not what it holds from the start)."""
        import openvino as ov

        self.blocks = max(1, int(blocks))
        for name, kind, shape in self._caches:
            self.request.set_tensor(name, ov.Tensor(kind, [self.blocks, *shape]))

    def start(self, work: Sequence[SeqWork]) -> None:
        """Begin one forward pass over every sequence's new ids and return at once:
        OpenVINO's threads compute it, without the GIL, while the caller does other work;
        result() waits for it."""
        ids, positions, past, begins, table, table_begins, rows = [], [], [], [0], [], [0], []
        for w in work:
            n = len(w.ids)
            if n == 0 or len(w.blocks) * self.block_size < w.past + n or max(w.blocks, default=0) >= self.blocks:
                # the kernel would write outside the pool: a scheduler bug, not a crash of the process
                raise ValueError(f"a sequence's blocks do not cover its {w.past + n} positions")
            ids.extend(w.ids)
            positions.extend(range(w.past, w.past + n))
            past.append(w.past)
            begins.append(begins[-1] + n)
            table.extend(w.blocks)
            table_begins.append(len(table))
            rows.extend(range(begins[-1] - w.logits, begins[-1]))
        if not rows:
            rows = [0]  # the Gather needs a row; nobody reads it
        feed = {"input_ids": np.asarray(ids, dtype=np.int64), "position_ids": np.asarray(positions, dtype=np.int64),
                "past_lens": np.asarray(past, dtype=np.int32), "subsequence_begins": np.asarray(begins, dtype=np.int32),
                "block_indices": np.asarray(table, dtype=np.int32),
                "block_indices_begins": np.asarray(table_begins, dtype=np.int32),
                "max_context_len": np.asarray(max(w.past + len(w.ids) for w in work), dtype=np.int32),
                SAMPLED: np.asarray(rows, dtype=np.int64)}
        if self._running:  # a pass nobody waited for (a failure in between) ends before its inputs change
            self._wait()
        self._set_inputs(feed)
        self.request.start_async()
        self._running = True

    def _set_inputs(self, feed: dict[str, np.ndarray]) -> None:
        """Hand the request this pass's inputs without a copy per pass. Each input lives in
        a tensor of the input's own type set once per shape: an input whose shape is the last
        pass's is written into that tensor's memory in place (that pass has ended: result()
        waited), any other gets a new tensor. Handing them over as a dict copied them into the
        request's tensors and took most of start() -- time in which no pass runs, every token
        of a one-request decode."""
        import openvino as ov

        for name, value in feed.items():
            port = self._ports.get(name)
            if port is None:
                continue
            held = self._held.get(name)
            if held is None or held.shape != value.shape:
                tensor = ov.Tensor(port.get_element_type(), ov.Shape(list(value.shape)))
                self.request.set_tensor(port, tensor)
                held = self._held[name] = tensor.data  # the tensor's memory, as an array
            held[...] = value

    def result(self) -> np.ndarray:
        """Wait for the pass start() began; the logits rows each sequence asked for, in
        order, float32 [rows, vocab] (a copy). A pass that failed raises here."""
        self._wait()
        out = self.request.get_output_tensor(0).data  # [rows, 1, vocab]
        return np.array(out[:, -1, :], dtype=np.float32)

    def _wait(self) -> None:
        try:
            self.request.wait()
        finally:
            self._running = False

    def close(self) -> None:
        self.request = None
        self.compiled = None

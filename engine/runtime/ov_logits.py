"""Compute only the logits a caller needs: a `logits_to_keep` input before the LM head.

An exported causal LM computes logits for every position it is fed: a
512-token prefill chunk of a 32k-vocabulary model spends 512 × hidden × vocab
multiply-adds (and a [1, 512, vocab] f32 buffer) on rows nobody reads, since
generation only needs the last one. openvino_genai slices the hidden states
before the LM-head MatMul for the same reason. Here the slice is steered by a
new input, with the meaning transformers gives `logits_to_keep`:

    logits_to_keep = [k], k > 0: logits of the last min(k, n) positions  [b, min(k, n), vocab]
    logits_to_keep = [0]:        logits of every position                [b, n, vocab]

so a plain stream feeds [1], and a speculative verify step that needs the
K+1 last positions feeds [0] (or [K+1]). The slice sits between the final norm
and the MatMul: the norm is per position, so the rows kept are the same rows of
the unsliced model (up to float rounding: the MatMul kernel for 1 row may sum
in another order than for n rows; the tests allow 1e-5).
"""

from __future__ import annotations

from typing import Any

LOGITS_TO_KEEP = "logits_to_keep"  # the input's name (transformers' name for the same thing)
# Element-wise ops an LM head's output may pass through before "logits" (Gemma's
# soft-capping: Divide -> Tanh -> Multiply; a Convert to f32). Followed through
# input 0 when every other input is a Constant.
_PASS_THROUGH = {"Convert", "Multiply", "Divide", "Tanh", "Add", "Subtract"}


def find_lm_head(model: Any) -> Any | None:
    """The MatMul producing the "logits" output, or None when there is none to find."""
    try:
        node = model.output("logits").get_node().input_value(0).get_node()
    except RuntimeError:
        return None
    for _ in range(8):
        kind = node.get_type_name()
        if kind == "MatMul":
            return node
        if kind not in _PASS_THROUGH:
            return None
        others = [v.get_node().get_type_name() for v in node.input_values()[1:]]
        if any(o != "Constant" for o in others):
            return None
        node = node.input_value(0).get_node()
    return None


def add_logits_to_keep(model: Any) -> bool:
    """Insert the `logits_to_keep` input and its Slice into `model` (in place).

    True when the model has it afterwards (added now or before); False when
    no LM head MatMul on [batch, seq, hidden] was found (the model is unchanged).
    """
    import openvino as ov
    import openvino.opset13 as ops

    if any(LOGITS_TO_KEEP in p.get_output_tensor(0).get_names() for p in model.get_parameters()):
        return True
    matmul = find_lm_head(model)
    if matmul is None:
        return False
    hidden = matmul.input_value(0)  # [b, n, H]
    if hidden.get_partial_shape().rank.is_dynamic or hidden.get_partial_shape().rank.get_length() != 3:
        return False
    keep = ops.parameter(ov.PartialShape([1]), ov.Type.i64, name=LOGITS_TO_KEEP)
    keep.output(0).get_tensor().set_names({LOGITS_TO_KEEP})
    i64 = ov.Type.i64
    n = ops.gather(ops.shape_of(hidden, i64), ops.constant([1], i64), ops.constant(0, i64))  # [1]: n
    zero = ops.constant([0], i64)
    # k = 0 -> n; else min(k, n)
    kept = ops.select(ops.greater(keep, zero), ops.minimum(keep, n), n)  # [1]
    start = ops.subtract(n, kept)  # [1]: first position kept
    stop = ops.constant([2**62], i64)  # past the end: "to the last position"
    sliced = ops.slice(hidden, start, stop, ops.constant([1], i64), ops.constant([1], i64))  # [b, kept, H]
    matmul.input(0).replace_source_output(sliced.output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
    return True

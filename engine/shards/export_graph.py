"""The exported shard's graph: the piece IRs stitched into one model, beam_idx, stateful KV.

What export.export_shard does to the pieces once they are traced (export_pieces):
the I/O and state layout it builds are described in export.py's docstring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _stitch(xmls: list[Path], labels: list[str]):
    """Chain the piece IRs into one model: a piece's hidden input reads the
    previous piece's output; every piece shares the first one's attention_mask
    and position_ids. Returns (model, past names, present names) in layer order."""
    import openvino as ov
    from openvino import opset13

    core = ov.Core()
    models = [core.read_model(str(x)) for x in xmls]  # weights memory-mapped
    params: dict[str, Any] = {}  # name -> the Parameter node the stitched model keeps
    past_names, present_names, presents, heads = [], [], [], []
    cur = None  # the previous piece's hidden output
    for label, m in zip(labels, models):
        for op in m.get_ops():  # distinct friendly names per piece
            op.set_friendly_name(f"{label}/{op.get_friendly_name()}")
        for port in m.inputs:
            name, node = port.get_any_name(), port.get_node()
            if name == "hidden_states" and cur is not None:
                node.output(0).replace(cur)
            elif name in params:
                node.output(0).replace(params[name].output(0))
            else:
                params[name] = node
                if name.startswith("past_key_values."):
                    past_names.append(name)
        for port in m.outputs:
            name = port.get_any_name()
            if name.startswith("present."):
                present_names.append(name)
                presents.append(port.get_node())
            elif name in ("logits", "next_token"):
                heads.append(port.get_node())
        if "hidden_states_out" in {n for o in m.outputs for n in o.get_names()}:
            cur = m.output("hidden_states_out").get_node().input_value(0)
            cur.get_tensor().set_names(set())  # internal unless it is the stage's output
    if heads:
        results = heads + presents
    else:
        cur.get_tensor().set_names({"hidden_states_out"})
        results = [opset13.result(cur)] + presents
    x = params.get("input_ids") or params["hidden_states"]
    order = [x, params["attention_mask"], params["position_ids"]] + [params[n] for n in past_names]
    if "logits_to_keep" in params:
        order.append(params["logits_to_keep"])
    model = ov.Model(results, order, "flotilla_shard")
    model.validate_nodes_and_infer_types()
    return model, past_names, present_names


def _ordered_states(ov_model, past_names: list[str]) -> list[str]:
    """Variable ids (OpenVINO names them input + output name) in layer order."""
    ids = [op.get_variable_id() for op in ov_model.get_ops() if op.get_type_name() == "ReadValue"]
    rank = {name: i for i, name in enumerate(past_names)}
    return sorted(ids, key=lambda v: next((i for n, i in rank.items() if v.startswith(n + "present")), len(rank)))


def _fuse_cache_reorder(ov_model, past_names: list[str]) -> None:
    """Add `beam_idx` (int32 [batch]) and read every past K/V through Gather(., beam_idx, 0).

    Same idea as optimum-intel's fuse_cache_reorder: after make_stateful the
    Gather sits between ReadValue and the concat, the pattern the plugins fuse.
    """
    import openvino as ov
    from openvino import opset13

    batch = ov_model.inputs[0].get_partial_shape()[0]
    beam_idx = opset13.parameter(ov.PartialShape([batch]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    axis = opset13.constant(np.int64(0))
    for name in past_names:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, axis)
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()


def _make_stateful(ov_model, pairs: dict[str, str], x_name: str) -> None:
    """Turn past/present pairs into ReadValue/Assign; initialise states empty.

    The initial value of each state is zeros [batch, kv_heads, 0, head_dim]
    with batch read from the main input, so `reset_state()` alone yields a
    valid empty cache.
    """
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(ov_model, pairs)
    x = ov_model.input(x_name)
    batch = opset13.gather(opset13.shape_of(x, output_type="i64"), opset13.constant(np.array([0], np.int64)),
                           opset13.constant(np.int64(0)))
    for op in ov_model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims = [d.get_length() if d.is_static else 0 for d in op.get_output_partial_shape(0)]
        parts = [batch] + [opset13.constant(np.array([d], np.int64)) for d in dims[1:]]
        shape = opset13.concat(parts, axis=0)
        zero = opset13.constant(np.array(0.0, dtype=np.float32)).output(0)
        op.set_arguments([opset13.broadcast(opset13.convert(zero, op.get_output_element_type(0)), shape)])
    ov_model.validate_nodes_and_infer_types()

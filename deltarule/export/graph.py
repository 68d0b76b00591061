"""The exported ONNX graph made final for a target: placeholder ops renamed into the target's
domain, dimensions named as the runtimes expect, and checks that refuse a graph a runtime
would reject later.

Targets (`TARGETS`):

- ``"ort"``: ONNX Runtime's ``com.microsoft.LinearAttention`` and
  ``com.microsoft.CausalConvWithState`` (CPU kernels from onnxruntime 1.32; WebGPU in
  onnxruntime-web), default opset 18;
- ``"onnx"``: the standard ``LinearAttention`` and ``CausalConvWithState`` of opset 27 (no
  onnxruntime kernel yet: `deltarule.onnx.run` computes them, and onnx's ``ReferenceEvaluator``).
"""

from __future__ import annotations

import re
from collections import Counter

import onnx

from ..errors import Unsupported
from .translate import PLACEHOLDER, PLACEHOLDER_OPS

TARGETS = {"ort": ("com.microsoft", 1), "onnx": ("", 27)}
# the dimension names: transformers.js resolves `batch_size` (every other symbol of a past input to 0)
DIMENSIONS = ("batch_size", "sequence_length", "past_sequence_length", "total_sequence_length")
_LOOPS = ("Scan", "Loop")


def finish(model: onnx.ModelProto, target: str, *, symbols: dict) -> onnx.ModelProto:
    """`model` (torch.onnx's, with placeholders) for `target`, in place; `symbols` maps torch's
    symbol names (``s10``) to `DIMENSIONS`' names."""
    domain, version = TARGETS[target]
    for node in model.graph.node:
        if node.domain == PLACEHOLDER:
            node.domain = domain
            node.op_type = next(name for name, placeholder in PLACEHOLDER_OPS.items() if placeholder == node.op_type)
    imports = [o for o in model.opset_import if o.domain not in (PLACEHOLDER, domain)]
    if domain == "":
        base = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
        imports = [o for o in imports if o is not base]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    model.opset_import.append(onnx.helper.make_opsetid(domain, version))
    _name_dimensions(model, symbols)
    return model


def _name_dimensions(model: onnx.ModelProto, symbols: dict) -> None:
    """Rename symbolic dimensions of the graph's inputs, outputs and value infos; a sum of two
    named ones (``s15 + s22``: past + new) becomes ``total_sequence_length``."""
    def rename(value):
        for dim in value.type.tensor_type.shape.dim:
            if not dim.dim_param:
                continue
            parts = [p.strip() for p in dim.dim_param.split("+")]
            if len(parts) == 1 and parts[0] in symbols:
                dim.dim_param = symbols[parts[0]]
            elif len(parts) == 2 and {symbols.get(p) for p in parts} == {"past_sequence_length", "sequence_length"}:
                dim.dim_param = "total_sequence_length"
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        rename(value)


def symbols_of(model: onnx.ModelProto, roles: dict) -> dict:
    """torch's symbols by role: `roles` maps (input name, axis) to a `DIMENSIONS` name."""
    found = {}
    for value in model.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            role = roles.get((value.name, axis))
            if role and dim.dim_param and re.fullmatch(r"s\d+", dim.dim_param):
                found[dim.dim_param] = role
    return found


def check(model: onnx.ModelProto, target: str, *, linear_layers: int, convs: int) -> Counter:
    """Refuse a graph that is not what the export promises: a token loop (Scan / Loop), a
    linear-attention or conv node count other than the model's, or an op the target's opset
    lacks. Returns the count of (domain, op) nodes."""
    ops = Counter((node.domain, node.op_type) for node in model.graph.node)
    loops = [op for op in ops if op[1] in _LOOPS]
    if loops:
        raise Unsupported(f"the exported graph has a token loop ({', '.join(op for _, op in loops)}): "
                          f"every linear-attention layer should be one LinearAttention node")
    domain, _ = TARGETS[target]
    for name, want in (("LinearAttention", linear_layers), ("CausalConvWithState", convs)):
        if ops[(domain, name)] != want:
            raise Unsupported(f"the exported graph has {ops[(domain, name)]} {domain or 'onnx'}.{name} nodes "
                              f"for {want} layers")
    return ops

"""The exported ONNX graph made final for a target: placeholder ops renamed into the target's
domain, dimensions named as the runtimes expect, and checks that refuse a graph a runtime
would reject later.

Targets (`TARGETS`):

- ``"ort"``: ONNX Runtime's ``com.microsoft.LinearAttention`` and
  ``com.microsoft.CausalConvWithState`` (CPU kernels from onnxruntime 1.32; WebGPU in
  onnxruntime-web), default opset 23;
- ``"onnx"``: the standard ``LinearAttention`` and ``CausalConvWithState`` of opset 27
  (onnxruntime 1.32 runs them too; so do `deltarule.onnx.run` and onnx's ``ReferenceEvaluator``);
- ``"ort-gpu"``: ONNX Runtime's ``com.microsoft.GatedDeltaNet`` (the form its CUDA and WebGPU
  execution providers run, and its CPU one: onnxruntime >= 1.32) and
  ``com.microsoft.CausalConvWithState``: rank-4 query / key / value, value heads a multiple of
  query heads (GQA is refused), the L2 norm in the node; `finish` then fuses transformers'
  gate and beta ops into the node and makes the decoder's recurrent state inputs and outputs
  V-major [B, Hv, V, K], the node's layout (`deltarule.onnx.export.fuse`). Not for WebGPU: KDA's
  per-key decay (Kimi Linear), which ONNX Runtime's WebGPU kernel does not implement.

Gated DeltaNet-2 layers become ``ai.deltarule::LinearAttention`` on every target, with its
function body.
"""

from __future__ import annotations

import re
from collections import Counter

import onnx

from ...errors import Unsupported
from .. import custom_op as deltarule_ops
from . import fuse
from .translate import GATED_DELTA_NET_TARGETS, PLACEHOLDER, PLACEHOLDERS

TARGETS = {"ort": ("com.microsoft", 1), "onnx": ("", 27), "ort-gpu": ("com.microsoft", 1)}
# the dimension names: transformers.js resolves `batch_size` (every other symbol of a past input to 0)
DIMENSIONS = ("batch_size", "sequence_length", "past_sequence_length", "total_sequence_length")
_LOOPS = ("Scan", "Loop")


def finish(model: onnx.ModelProto, target: str, *, symbols: dict) -> onnx.ModelProto:
    """`model` (torch.onnx's, with placeholders) for `target`; `symbols` maps torch's symbol
    names (``s10``) to `DIMENSIONS`' names. In place, except where Gated DeltaNet-2 nodes get
    their function bodies (`deltarule.onnx.custom_op.attach_functions`: a copy)."""
    domain, version = TARGETS[target]
    for node in model.graph.node:
        if node.domain == PLACEHOLDER:
            fixed, node.op_type = PLACEHOLDERS[node.op_type]
            node.domain = domain if fixed is None else fixed
    imports = [o for o in model.opset_import if o.domain not in (PLACEHOLDER, domain)]
    if domain == "":
        base = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
        imports = [o for o in imports if o is not base]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    model.opset_import.append(onnx.helper.make_opsetid(domain, version))
    _name_dimensions(model, symbols)
    if target in GATED_DELTA_NET_TARGETS:
        fuse.gates(model)
        fuse.v_major_state(model)
    if any(deltarule_ops.is_deltarule_node(node) for node in model.graph.node):
        model = deltarule_ops.attach_functions(model)
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
    """Refuse a graph that is not what the export promises: a token loop (Scan / Loop), or a
    linear-attention or conv node count other than the model's. Returns the count of (domain,
    op) nodes. (That every op exists in the target's opsets is onnx.checker's part: the tests
    run it on every export.)"""
    ops = Counter((node.domain, node.op_type) for node in model.graph.node)
    loops = [op for op in ops if op[1] in _LOOPS]
    if loops:
        raise Unsupported(f"the exported graph has a token loop ({', '.join(op for _, op in loops)}): "
                          f"every linear-attention layer should be one LinearAttention node")
    domain, _ = TARGETS[target]
    linear = ("com.microsoft", "GatedDeltaNet") if target in GATED_DELTA_NET_TARGETS else (domain, "LinearAttention")
    found = {linear[1]: ops[linear] + ops[(deltarule_ops.DOMAIN, "LinearAttention")],
             "CausalConvWithState": ops[(domain, "CausalConvWithState")]}
    for name, want in ((linear[1], linear_layers), ("CausalConvWithState", convs)):
        if found[name] != want:
            raise Unsupported(f"the exported graph has {found[name]} {name} nodes for {want} layers")
    return ops

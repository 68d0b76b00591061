"""Rewrites of the converted decoder that drop work the runtimes need not do.

- `shared_kv_heads`: transformers' ``repeat_kv`` (grouped-query attention: each key / value head
  copied for its query heads, ``Unsqueeze(axis 2) -> Expand -> Reshape``) removed before
  ONNX ``Attention`` nodes, which take grouped heads natively (query head i reads key / value
  head i // (q_heads / kv_heads), transformers' grouping). The copy cost a Qwen3.5-0.8B decode
  step ~22 ms of ~200 on ONNX Runtime's CPU.
- `merge_sibling_matmuls`: the weight MatMuls that read the same activation (a layer's q / k / v
  projections, the MLP's gate and up, Gated DeltaNet's qkv and z) become one MatMul over the
  weights side by side and a ``Split``: one larger product (one quantized activation per step
  for MatMulNBits' int8 path) in place of several. Block quantization runs down each column, so
  quantizing the merged weight quantizes every column exactly as before. `narrow` weights (fewer
  than 1/16 as many columns as rows: Gated DeltaNet's a / b gate projections, one column per
  head) merge only among themselves, and the quantizer leaves them float
  (`deltarule.onnx.export.quantize`), as onnxruntime-genai's builder does.
- `skip_rms_norms` (ONNX Runtime's targets): a residual ``Add`` followed by ``RMSNormalization``
  of its sum becomes ``com.microsoft.SkipSimplifiedLayerNormalization`` (the sum is its fourth
  output where later layers read it): one node for two, as onnxruntime-genai's builder emits.
- `l2_norms` (opset >= 23): the L2 norm of q and k before a linear-attention node, x /
  sqrt(sum(x^2) + eps) as ``ReduceSumSquare -> Add -> Sqrt -> Div``, becomes one
  ``RMSNormalization`` (x / sqrt(mean(x^2) + eps / K) * K^-1/2: the same value to float32
  rounding): 3 nodes fewer per norm, 108 at the Qwen3.5-0.8B shape.
- `keep_last_logits`: a ``num_logits_to_keep`` input (int64 scalar, transformers.js's and
  transformers' ``logits_to_keep``: 0 computes every position's logits, n > 0 the last n) that
  slices the hidden states before the LM head: a 1024-token prefill computes one row of
  logits instead of 1024.
"""

from __future__ import annotations

import heapq

import numpy as np
import onnx
from onnx import TensorProto, helper

NUM_LOGITS_TO_KEEP = "num_logits_to_keep"
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)


def _producers(graph) -> dict:
    return {out: node for node in graph.node for out in node.output}


def _constant(graph, name: str | None, kind=int) -> list | None:
    """The values of `name` (as `kind`) when it is an initializer or a Constant node's output."""
    for t in graph.initializer:
        if name is not None and t.name == name:
            return [kind(x) for x in onnx.numpy_helper.to_array(t).reshape(-1)]
    for node in graph.node:
        if name is not None and node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    return [kind(x) for x in onnx.numpy_helper.to_array(a.t).reshape(-1)]
    return None


def _ranks(model: onnx.ModelProto) -> dict:
    """Known ranks of the graph's values (inputs, outputs, value infos)."""
    graph = model.graph
    return {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.input, *graph.output, *graph.value_info)
            if v.type.tensor_type.HasField("shape")}


def _remove_dead(graph) -> None:
    """Nodes none of whose outputs is read (by a node or as a graph output), repeatedly."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in node.input} | outputs
        dead = [node for node in graph.node if not any(out in read for out in node.output)]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)


def shared_kv_heads(model: onnx.ModelProto) -> int:
    """Bypass ``repeat_kv`` before every standard ``Attention`` node's key and value (module
    docstring), in place; returns how many inputs were rewritten. Only the exact pattern on a
    rank-4 key / value is rewritten."""
    graph = model.graph
    producers, ranks = _producers(graph), _ranks(model)
    rewritten = 0
    for node in graph.node:
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            continue
        for slot in (1, 2):
            reshape = producers.get(node.input[slot])
            expand = producers.get(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
            unsqueeze = producers.get(expand.input[0]) if expand is not None and expand.op_type == "Expand" else None
            if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.input) < 2:
                continue
            source = unsqueeze.input[0]
            if _constant(graph, unsqueeze.input[1]) != [2] or ranks.get(source) != 4:
                continue
            node.input[slot] = source
            rewritten += 1
    _remove_dead(graph)
    return rewritten


def narrow(weight: onnx.TensorProto) -> bool:
    """A weight [K, N] with N < K / 16 (module docstring)."""
    return weight.dims[1] * 16 < weight.dims[0]


def weight_matmuls(model: onnx.ModelProto) -> list:
    """(node, weight initializer) of each standard MatMul whose second input is a 2-D float
    initializer [K, N]."""
    weights = {t.name: t for t in model.graph.initializer if len(t.dims) == 2 and t.data_type in _FLOAT_TYPES}
    return [(node, weights[node.input[1]]) for node in model.graph.node
            if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in weights]


def merge_sibling_matmuls(model: onnx.ModelProto) -> int:
    """Merge the weight MatMuls reading one activation (module docstring), in place; returns the
    number of MatMuls removed. A weight read by anything else is left alone."""
    graph = model.graph
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    groups = {}
    for node, weight in weight_matmuls(model):
        if readers[weight.name] != 1:
            continue
        groups.setdefault((node.input[0], weight.dims[0], weight.data_type, narrow(weight)), []).append((node, weight))
    removed = 0
    order = {id(node): i for i, node in enumerate(graph.node)}
    for (activation, _, _, _), members in groups.items():
        if len(members) < 2:
            continue
        members.sort(key=lambda m: order[id(m[0])])
        arrays = [onnx.numpy_helper.to_array(w) for _, w in members]
        merged_name = "+".join(w.name for _, w in members)
        merged = onnx.numpy_helper.from_array(np.concatenate(arrays, axis=1), name=merged_name)
        product = f"{merged_name}.product"
        split_sizes = f"{merged_name}.split"
        first = members[0][0]
        index = list(graph.node).index(first)
        new_nodes = [
            helper.make_node("MatMul", [activation, merged_name], [product], name=f"{first.name}.merged"),
            helper.make_node("Split", [product, split_sizes], [n.output[0] for n, _ in members], axis=-1,
                             name=f"{first.name}.split"),
        ]
        for node, weight in members:
            graph.node.remove(node)
            graph.initializer.remove(weight)
        for offset, node in enumerate(new_nodes):
            graph.node.insert(index + offset, node)
        graph.initializer.extend([merged, helper.make_tensor(split_sizes, TensorProto.INT64, [len(members)],
                                                             [int(a.shape[1]) for a in arrays])])
        removed += len(members) - 1
    return removed


def _shapes(model: onnx.ModelProto) -> dict:
    """name -> dims (int or dim_param str; None unknown) of the values with a known shape."""
    graph = model.graph
    return {v.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in v.type.tensor_type.shape.dim]
            for v in (*graph.input, *graph.output, *graph.value_info) if v.type.tensor_type.HasField("shape")}


def _attribute(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def skip_rms_norms(model: onnx.ModelProto) -> int:
    """Fuse residual Add + RMSNormalization (module docstring), in place; returns the count.
    Only an Add of two tensors of one known rank-3 shape (no broadcast) feeding a float32-stashed
    RMSNormalization over the last axis with a rank-1 scale."""
    graph = model.graph
    producers, shapes = _producers(graph), _shapes(model)
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    fused = []
    for norm in list(graph.node):
        if norm.op_type != "RMSNormalization" or norm.domain not in ("", "ai.onnx") or len(norm.input) != 2:
            continue
        add = producers.get(norm.input[0])
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
            continue
        a, b, scale = shapes.get(add.input[0]), shapes.get(add.input[1]), shapes.get(norm.input[1])
        if not a or a != b or len(a) != 3 or None in a or scale is None or len(scale) != 1:
            continue
        if _attribute(norm, "axis", -1) not in (-1, 2) or _attribute(norm, "stash_type", 1) != 1:
            continue
        if any(out for out in norm.output[1:]):
            continue
        keeps_sum = add.output[0] in outputs or len(readers.get(add.output[0], ())) > 1
        node = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0] if keeps_sum else ""], domain="com.microsoft",
            epsilon=float(_attribute(norm, "epsilon", 1e-5)), name=f"{norm.name}.skip")
        index = list(graph.node).index(norm)
        graph.node.insert(index, node)
        graph.node.remove(norm)
        graph.node.remove(add)
        fused.append(node)
    if fused:
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        _sort_topologically(graph)
    return len(fused)


def l2_norms(model: onnx.ModelProto) -> int:
    """Rewrite each L2 norm over the last axis of a float32 tensor with a static last dimension
    as RMSNormalization (module docstring), in place, where the model imports opset >= 23;
    returns the count."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 23:
        return 0
    graph = model.graph
    producers, shapes = _producers(graph), _shapes(model)
    rewritten = 0
    for div in list(graph.node):
        if div.op_type != "Div" or div.domain not in ("", "ai.onnx"):
            continue
        x = div.input[0]
        sqrt = producers.get(div.input[1])
        add = producers.get(sqrt.input[0]) if sqrt is not None and sqrt.op_type == "Sqrt" else None
        if add is None or add.op_type != "Add":
            continue
        square = next((producers.get(i) for i in add.input if producers.get(i) is not None
                       and producers[i].op_type == "ReduceSumSquare"), None)
        eps_name = next((i for i in add.input if square is None or i != square.output[0]), None)
        eps = _constant(graph, eps_name, float)
        shape = shapes.get(x)
        if square is None or square.input[0] != x or eps is None or len(eps) != 1 or not shape \
                or not isinstance(shape[-1], int) or shape[-1] <= 0:
            continue
        if _constant(graph, square.input[1]) not in ([-1], [len(shape) - 1]) or _attribute(square, "keepdims", 1) != 1:
            continue
        if _elem_type(model, x) != TensorProto.FLOAT:
            continue
        K = shape[-1]
        scale = f"l2_norm.scale.{K}"
        if not any(t.name == scale for t in graph.initializer):
            graph.initializer.append(onnx.numpy_helper.from_array(np.full(K, K ** -0.5, np.float32), name=scale))
        node = helper.make_node("RMSNormalization", [x, scale], [div.output[0]], axis=-1,
                                epsilon=float(np.float32(eps[0]) / np.float32(K)), stash_type=1, name=f"{div.name}.l2")
        graph.node.insert(list(graph.node).index(div), node)
        graph.node.remove(div)
        rewritten += 1
    _remove_dead(graph)
    return rewritten


def _elem_type(model, name) -> int | None:
    graph = model.graph
    for v in (*graph.input, *graph.output, *graph.value_info):
        if v.name == name:
            return v.type.tensor_type.elem_type
    return None


def _sort_topologically(graph) -> None:
    """Reorder the nodes so each comes after its inputs' producers (stable: the given order
    where it already holds)."""
    nodes = list(graph.node)
    made = {out for node in nodes for out in node.output if out}
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    waiting = {id(node): sum(1 for name in set(node.input) if name in made and name not in ready) for node in nodes}
    readers = {}
    for node in nodes:
        for name in set(node.input):
            if name in made:
                readers.setdefault(name, []).append(node)
    position = {id(node): i for i, node in enumerate(nodes)}
    heap = [(position[id(n)], id(n), n) for n in nodes if waiting[id(n)] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, node = heapq.heappop(heap)
        order.append(node)
        for out in node.output:
            for reader in readers.get(out, ()):
                waiting[id(reader)] -= 1
                if waiting[id(reader)] == 0:
                    heapq.heappush(heap, (position[id(reader)], id(reader), reader))
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle")
    copies = [onnx.NodeProto.FromString(n.SerializeToString()) for n in order]
    del graph.node[:]
    graph.node.extend(copies)


def keep_last_logits(model: onnx.ModelProto) -> None:
    """Add the ``num_logits_to_keep`` input (module docstring), in place: the LM head's input
    (the MatMul that makes ``logits``, through Casts) sliced to its last n positions (all for
    0); ``logits``' sequence dimension becomes ``logits_length``. Raises ValueError when no
    such MatMul is found."""
    graph = model.graph
    producers = _producers(graph)
    head = producers.get("logits")
    while head is not None and head.op_type in ("Cast", "Identity"):
        head = producers.get(head.input[0])
    if head is None or head.op_type != "MatMul":
        raise ValueError("the LM head (a MatMul making logits) was not found")
    hidden = head.input[0]
    sliced, start = f"{hidden}.last", f"{NUM_LOGITS_TO_KEEP}.start"
    nodes = [
        helper.make_node("Neg", [NUM_LOGITS_TO_KEEP], [f"{NUM_LOGITS_TO_KEEP}.neg"], name="logits_to_keep_neg"),
        helper.make_node("Reshape", [f"{NUM_LOGITS_TO_KEEP}.neg", "logits_to_keep.one"], [start],
                         name="logits_to_keep_start"),
        helper.make_node("Slice", [hidden, start, "logits_to_keep.end", "logits_to_keep.axis"], [sliced],
                         name="logits_to_keep_slice"),
    ]
    graph.initializer.extend([
        helper.make_tensor("logits_to_keep.one", TensorProto.INT64, [1], [1]),
        helper.make_tensor("logits_to_keep.end", TensorProto.INT64, [1], [(1 << 63) - 1]),
        helper.make_tensor("logits_to_keep.axis", TensorProto.INT64, [1], [1]),
    ])
    index = list(graph.node).index(head)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)
    head.input[0] = sliced
    graph.input.append(helper.make_tensor_value_info(NUM_LOGITS_TO_KEEP, TensorProto.INT64, []))
    for value in (*graph.output, *graph.value_info):
        if value.name == "logits" and len(value.type.tensor_type.shape.dim) == 3:
            dim = value.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_param = "logits_length"
    stale, consumers = {head.output[0]}, {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    frontier = [head.output[0]]
    while frontier:                              # the head's output and the Casts after it
        for node in consumers.get(frontier.pop(), ()):
            if node.op_type in ("Cast", "Identity"):
                stale.update(node.output)
                frontier.extend(node.output)
    kept = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept)

"""Target ``"ort-gpu"``'s graph passes (docs/export.md, "Targets"): transformers' gate and beta
ops fused into each ``com.microsoft.GatedDeltaNet`` node (`gates`), and the decoder's recurrent
state taken and given V-major, the node's layout, without a Transpose on either side
(`v_major_state`).

transformers' Gated DeltaNet layers compute the gates before the kernel call, so the trace holds
them as standard ops. For each GatedDeltaNet node `gates` fuses

- ``beta = Sigmoid(b)`` (through Casts between float types) into ``beta_activation="sigmoid"``
  with ``b`` (float32) as beta;
- ``decay = rate * softplus(a + dt_bias)`` into ``gate_activation="qwen"`` with ``a`` (float32) as
  decay and ``a_log`` / ``dt_bias`` float32 ``[Hv]`` initializers: ``rate`` is ``-exp(A_log)``,
  either as ops (``Neg(Exp(A_log))``) or as the constant torch.onnx's optimizer folds it into
  (then ``a_log = log(-rate)``, rounded so that float32 ``-exp(a_log)`` gives the constant
  back where one float32 value does); ``softplus`` is ``Softplus(x)`` or torch's
  ``Where(Greater(x, threshold), x, Softplus(x))`` (threshold >= 15: above it softplus(x) and x
  agree to float32 rounding); Mul and Add in either operand order, Casts between float types
  allowed around each.

Only an exact match is rewritten (a per-head rate and bias of the node's value heads, a rank-3
decay); anything else is left as it is. Nodes left without a consumer are removed after, with
the initializers only they read. In a 16-bit export the fused sigmoid / gate run in float32
where transformers rounded beta to 16 bits first: the fused graph is the more exact one.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

_FLOAT = onnx.TensorProto.FLOAT
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
_BETA, _DECAY, _A_LOG, _DT_BIAS = 5, 4, 7, 8           # GatedDeltaNet's input positions
# torch's softplus returns x above its threshold (20 by default); from 15 on softplus(x) - x =
# log1p(exp(-x)) < 3.1e-7, under half a float32 ulp of x
_MIN_THRESHOLD = 15.0


def gates(model: onnx.ModelProto) -> dict:
    """Fuse the gate and beta ops of every ``com.microsoft.GatedDeltaNet`` node of `model`'s
    graph into the node (module docstring), in place; remove what is left dead. Returns the
    count of fusions: ``{"beta": n, "gate": n}``."""
    graph = _Graph(model.graph)
    fused = {"beta": 0, "gate": 0}
    for node in list(model.graph.node):
        if node.domain == "com.microsoft" and node.op_type == "GatedDeltaNet":
            fused["beta"] += graph.fuse_beta(node)
            fused["gate"] += graph.fuse_gate(node)
    if any(fused.values()):
        remove_dead(model.graph)
    return fused


# the decoder's recurrent state (`deltarule.onnx.export.decoder.state_layout`): input, output prefixes
PAST, PRESENT = "past_recurrent.", "present_recurrent."


def v_major_state(model: onnx.ModelProto) -> list[str]:
    """Each ``com.microsoft.GatedDeltaNet`` node whose state comes from the decoder's graph input
    ``past_recurrent.{i}`` through a ``Transpose(perm=[0, 1, 3, 2])`` and goes to its output
    ``present_recurrent.{i}`` through another ([B, Hv, K, V] as transformers keeps them) takes
    and gives that state as it is instead: the two Transposes are removed and the input's and
    output's declared dimensions 2 and 3 swapped, so both are V-major [B, Hv, V, K], the node's
    layout. Only where the input has no other reader (but Shape nodes of its dimensions 0 and
    1) and the output no other reader or writer; other graphs (a single call's:
    `exporter.to_onnx` of any program) keep the traced function's layout. In place; returns
    the inputs made V-major."""
    graph = model.graph
    inputs = {v.name: v for v in graph.input}
    outputs = {v.name: v for v in graph.output}
    producer = {o: node for node in graph.node for o in node.output if o}
    readers: dict = {}
    for node in graph.node:
        for x in node.input:
            readers.setdefault(x, []).append(node)

    def swap(perm_node) -> bool:
        return (perm_node.op_type == "Transpose" and perm_node.domain in ("", "ai.onnx")
                and list(_attribute(perm_node, "perm", [])) == [0, 1, 3, 2])

    done, removed = [], []
    for node in graph.node:
        if not (node.domain == "com.microsoft" and node.op_type == "GatedDeltaNet") or len(node.input) <= 6 \
                or len(node.output) < 2 or not node.input[6] or not node.output[1]:
            continue
        before = producer.get(node.input[6])
        after = readers.get(node.output[1], [])
        if before is None or not swap(before) or len(after) != 1 or not swap(after[0]):
            continue
        past, present = before.input[0], after[0].output[0]
        if not past.startswith(PAST) or present != PRESENT + past[len(PAST):]:
            continue
        others = [r for r in readers.get(past, []) if r is not before]
        if past not in inputs or present not in outputs or not all(_reads_leading_dims(r) for r in others) \
                or readers.get(node.input[6]) != [node] or present in readers or node.output[1] in outputs:
            continue
        node.input[6], node.output[1] = past, present
        removed += [before, after[0]]
        for value in (inputs[past], outputs[present]):
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 4:
                a, b = onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()
                a.CopyFrom(dims[3])
                b.CopyFrom(dims[2])
                dims[2].CopyFrom(a)
                dims[3].CopyFrom(b)
        done.append(past)
    if removed:
        for i in sorted((_index(graph.node, r) for r in removed), reverse=True):
            del graph.node[i]
        remove_dead(graph)
    return done


def _reads_leading_dims(node) -> bool:
    """Whether `node` reads only dimensions 0 and 1 of its rank-4 input: a Shape node ending
    there (the decoder takes the batch size from a state input)."""
    if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
        return False
    start, end = _attribute(node, "start", 0), _attribute(node, "end", None)
    if end is None:
        return False
    start, end = start + 4 if start < 0 else start, end + 4 if end < 0 else end
    return 0 <= start and end <= 2


def _index(nodes, node) -> int:
    """The position of `node` in `nodes` (its outputs are unique in a graph)."""
    return next(i for i, n in enumerate(nodes) if n is node or list(n.output) == list(node.output))


def remove_dead(graph: onnx.GraphProto) -> int:
    """Remove the nodes none of whose outputs is read (by a node, a subgraph or the graph's
    outputs), repeatedly, then the initializers and value infos nothing reads. Returns the
    count of nodes removed."""
    removed = 0
    while True:
        used = _used_names(graph)
        dead = [i for i, node in enumerate(graph.node) if not any(o in used for o in node.output if o)]
        if not dead:
            break
        for i in reversed(dead):
            del graph.node[i]
        removed += len(dead)
    used = _used_names(graph)
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
    produced = {o for node in graph.node for o in node.output} | {v.name for v in graph.input}
    infos = [v for v in graph.value_info if v.name in produced]
    if len(infos) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(infos)
    return removed


def _used_names(graph: onnx.GraphProto) -> set:
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(node.input)
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                used |= _outer_names(sub)
    used.discard("")
    return used


def _outer_names(graph: onnx.GraphProto) -> set:
    """Every name a subgraph reads (a superset of what it reads from the outer scope)."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                names |= _outer_names(sub)
    return names


def _attribute(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _set_attribute(node, name, value) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(onnx.helper.make_attribute(name, value))


class _Graph:
    """The producers, constants and element types of a graph, and the rewrites."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer = {o: node for node in graph.node for o in node.output if o}
        self.initializers = {t.name: t for t in graph.initializer}
        self.types, self.shapes = {}, {}
        for value in (*graph.input, *graph.value_info, *graph.output):
            tensor = value.type.tensor_type
            self.types[value.name] = tensor.elem_type
            if tensor.HasField("shape"):
                self.shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        for t in graph.initializer:
            self.types[t.name] = t.data_type
            self.shapes[t.name] = list(t.dims)
        for node in graph.node:
            if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
                self.types[node.output[0]] = _attribute(node, "to")
        self.names = set(self.producer) | set(self.types)

    # --- reading ------------------------------------------------------------------------
    def op(self, name: str, *ops: str):
        """The standard-domain node producing `name` if its op is one of `ops`, else None."""
        node = self.producer.get(name)
        if node is not None and node.domain in ("", "ai.onnx") and node.op_type in ops:
            return node
        return None

    def through_casts(self, name: str) -> str:
        """`name` with any chain of Casts between float types before it skipped."""
        while True:
            cast = self.op(name, "Cast")
            if cast is None or _attribute(cast, "to") not in _FLOATS or self.types.get(cast.input[0]) not in _FLOATS:
                return name
            name = cast.input[0]

    def constant(self, name: str):
        """The value of `name` (through Casts) if it is an initializer or a Constant node's, else None."""
        name = self.through_casts(name)
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.op(name, "Constant")
        if node is not None and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def heads(self, node) -> int | None:
        """The node's value heads (value [B, T, Hv, V]), when its shape says."""
        shape = self.shapes.get(node.input[2]) if len(node.input) > 2 else None
        return shape[2] if shape and len(shape) == 4 else None

    # --- writing ------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def as_float(self, name: str, before) -> str:
        """`name` in float32: itself, or a new Cast inserted before the node `before`."""
        if self.types.get(name) == _FLOAT:
            return name
        out = self.fresh(f"{name}_float")
        cast = onnx.helper.make_node("Cast", [name], [out], to=_FLOAT, name=self.fresh(f"{out}_cast"))
        nodes = self.graph.node
        index = _index(nodes, before)
        nodes.insert(index, cast)
        self.producer[out], self.types[out] = nodes[index], _FLOAT
        return out

    def initializer(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        self.types[name], self.shapes[name] = _FLOAT, list(value.shape)
        return name

    # --- the fusions --------------------------------------------------------------------
    def fuse_beta(self, node) -> int:
        if _attribute(node, "beta_activation", b"none") not in (b"none", "none"):
            return 0
        if len(node.input) <= _BETA or not node.input[_BETA]:
            return 0
        sigmoid = self.op(self.through_casts(node.input[_BETA]), "Sigmoid")
        if sigmoid is None or self.types.get(sigmoid.input[0]) not in _FLOATS:
            return 0
        node.input[_BETA] = self.as_float(sigmoid.input[0], node)
        _set_attribute(node, "beta_activation", "sigmoid")
        return 1

    def fuse_gate(self, node) -> int:
        if _attribute(node, "gate_activation", b"none") not in (b"none", "none"):
            return 0
        inputs = list(node.input)
        if len(inputs) <= _DECAY or not inputs[_DECAY] or any(inputs[_A_LOG:_DT_BIAS + 1]):
            return 0
        decay = inputs[_DECAY]
        shape = self.shapes.get(decay)
        H = self.heads(node)
        if H is None or shape is None or len(shape) != 3 or shape[2] not in (None, H):
            return 0                                   # per-key decay, or shapes not known: left
        mul = self.op(self.through_casts(decay), "Mul")
        if mul is None:
            return 0
        for rate_name, softplus_name in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            a_log = self._a_log(rate_name, H)
            x = self._softplus_input(softplus_name) if a_log is not None else None
            add = self.op(x, "Add") if x is not None else None
            if add is None:
                continue
            for raw, bias_name in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
                bias = self.constant(bias_name)
                if bias is None or bias.shape != (H,) or self.constant(raw) is not None \
                        or self.types.get(raw) not in _FLOATS:
                    continue
                while len(node.input) <= _DT_BIAS:
                    node.input.append("")
                node.input[_DECAY] = self.as_float(raw, node)
                node.input[_A_LOG] = self.initializer(f"{node.name or 'GatedDeltaNet'}.a_log", a_log)
                node.input[_DT_BIAS] = self.initializer(f"{node.name or 'GatedDeltaNet'}.dt_bias",
                                                        bias.astype(np.float32))
                _set_attribute(node, "gate_activation", "qwen")
                return 1
        return 0

    def _a_log(self, name: str, H: int):
        """float32 A_log [H] with -exp(A_log) == the rate `name` computes, or None: the rate
        as ``Neg(Exp(A_log))`` of a constant, or as a constant (all finite and negative)."""
        neg = self.op(self.through_casts(name), "Neg")
        if neg is not None:
            exp = self.op(self.through_casts(neg.input[0]), "Exp")
            value = self.constant(exp.input[0]) if exp is not None else None
            if value is None or value.shape != (H,) or value.dtype.kind != "f":
                return None
            return value.astype(np.float32)
        rate = self.constant(name)
        if rate is None or rate.shape != (H,) or rate.dtype.kind != "f" or not np.all(np.isfinite(rate)) \
                or not np.all(rate < 0):
            return None
        return a_log_of(rate.astype(np.float32))

    def _softplus_input(self, name: str):
        """x where `name` is softplus(x) (``Softplus(x)``, or torch's thresholded
        ``Where(Greater(x, t), x, Softplus(x))``), through Casts; else None."""
        name = self.through_casts(name)
        softplus = self.op(name, "Softplus")
        if softplus is not None:
            return softplus.input[0]
        where = self.op(name, "Where")
        if where is None:
            return None
        greater = self.op(where.input[0], "Greater")
        softplus = self.op(where.input[2], "Softplus")
        if greater is None or softplus is None:
            return None
        x = softplus.input[0]
        threshold = self.constant(greater.input[1])
        if greater.input[0] != x or where.input[1] != x or threshold is None or threshold.size != 1 \
                or not float(threshold.reshape(())) >= _MIN_THRESHOLD:
            return None
        return x


def a_log_of(rate: np.ndarray) -> np.ndarray:
    """float32 A_log with float32 ``-exp(A_log)`` equal to `rate` (float32, negative) where one
    float32 value gives it: log(-rate) rounded, or its float32 neighbour that does."""
    a = np.log(-rate.astype(np.float64)).astype(np.float32)
    best = a.copy()
    for candidate in (np.nextafter(a, np.float32(-np.inf)), np.nextafter(a, np.float32(np.inf))):
        exact = (-np.exp(best) != rate) & (-np.exp(candidate) == rate)
        best = np.where(exact, candidate, best)
    return best.astype(np.float32)

"""Run an ONNX model in ONNX Runtime with its linear-attention nodes computed by deltarule.

    from deltarule.onnx import run, Session
    outputs = run(model, {"x": x})                 # list, in the graph's output order
    session = Session(model)                       # build once, run many times
    outputs = session.run(None, {"x": x})          # InferenceSession.run's signature

Mechanism: graph partitioning. The top-level graph is cut at its
linear-attention nodes (`LINEAR_ATTENTION_OPS`). Every other node is given a
*stage*: the largest number of linear-attention nodes on any path into it
(ASAP scheduling). Stage s runs as one ONNX Runtime session built from the
sub-model of the stage-s nodes, then the stage-s linear-attention nodes run
through deltarule's adapters (they depend only on earlier stages, and on each
other never). Values cross the cut as NumPy arrays. So a model with L
sequential attention layers costs L + 1 ORT sessions plus L deltarule calls
per run, whatever happens around the attention nodes.

`com.microsoft.CausalConvWithState` nodes that ONNX Runtime's CPU kernel
refuses (`PARTIAL_OPS`: ndim > 1, `state_window`, the extended channel / state
attributes, a `state_update` output) are cut out and computed by deltarule the
same way; the others stay in ORT (its CPU kernel runs them, and a cut per
layer would cost a session each).

Sub-model sessions are built lazily on the first run, typed from the actual
arrays crossing the cut (dtype and rank; every dimension dynamic), and cached
per (dtype, rank) signature. Initializers a sub-model reads are copied into
it; graph inputs with an initializer (overridable defaults) stay inputs.

Limits: linear-attention nodes inside control-flow subgraphs (If / Loop /
Scan bodies) or inside model-local functions are not cut out: they run in
ORT as the model says (`ai.deltarule` ones through their function body,
which `attach_functions` provides; model-local functions are not inlined
first). Values crossing a cut must be tensors (no sequences, maps or
optionals).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..contracts import onnx_linear_attention as _onnx_contract
from ..contracts import ort as _ort_contract
from ..errors import ContractError
from . import feeds as _feeds
from . import custom_op as _ops

__all__ = ["LINEAR_ATTENTION_OPS", "PARTIAL_OPS", "Session", "run", "is_linear_attention_node",
           "computed_by_deltarule"]

# (domain, op_type) -> (deltarule implementation, the outputs the op defines)
LINEAR_ATTENTION_OPS = {
    ("", "LinearAttention"): (_onnx_contract.linear_attention, 2),
    # output, final_state, state_update (the adapter returns the third when state_update_capacity > 0)
    ("com.microsoft", "GatedDeltaNet"): (_ort_contract.gated_delta_net, 3),
    ("com.microsoft", "LinearAttention"): (_ort_contract.linear_attention, 2),
    (_ops.DOMAIN, _ops.OP_TYPE): (_ops.linear_attention, 2),
}
# ops ONNX Runtime's CPU kernel runs in part: deltarule computes the nodes it refuses
# (`_ort_cpu_refuses`), ORT the others. (domain, op_type) -> (implementation, outputs)
PARTIAL_OPS = {
    ("com.microsoft", "CausalConvWithState"): (_ort_contract.causal_conv_with_state, 3),
}
_CONV = ("com.microsoft", "CausalConvWithState")
# CausalConvWithState's attributes that onnxruntime 1.32's CPU kernel takes only at these values
_CONV_CPU_ONLY = dict(ndim=1, state_window=0, state_update_capacity=0, state_length=0, state_channels_last=-1,
                      input_channel_offset=0, input_channels=0)


def _node_contract(fn) -> tuple[list[str], list[str], list[str]]:
    """A kernel's node contract from its signature: its inputs (the positional parameters, in
    order), its attributes (the keyword-only ones) and the attributes without a default."""
    params = inspect.signature(fn).parameters.values()
    return ([p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD],
            [p.name for p in params if p.kind is p.KEYWORD_ONLY],
            [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty])


# taken at import, before anything (a test's spy) wraps the kernels
_CONTRACTS = {op: _node_contract(fn) for op, (fn, _) in {**LINEAR_ATTENTION_OPS, **PARTIAL_OPS}.items()}
# the default domain's LinearAttention exists from this opset on
LINEAR_ATTENTION_OPSET = 27


def _key(node: onnx.NodeProto):
    domain = "" if node.domain == "ai.onnx" else node.domain
    return domain, node.op_type


def is_linear_attention_node(node: onnx.NodeProto) -> bool:
    """Whether this node is one of the linear-attention ops (`LINEAR_ATTENTION_OPS`)."""
    return _key(node) in LINEAR_ATTENTION_OPS


def computed_by_deltarule(node: onnx.NodeProto) -> bool:
    """Whether `run` computes this node with deltarule: a linear-attention node, or a
    `PARTIAL_OPS` node that ONNX Runtime's CPU kernel refuses."""
    return is_linear_attention_node(node) or (_key(node) in PARTIAL_OPS and _ort_cpu_refuses(node))


def _ort_cpu_refuses(node: onnx.NodeProto) -> bool:
    """A CausalConvWithState node onnxruntime 1.32's CPU kernel does not run (it refuses
    ndim > 1, state_window > 0, the extended attributes and a third output: CUDA only)."""
    attrs = _ops.attribute_values(node)
    if any(attrs.get(name, default) != default for name, default in _CONV_CPU_ONLY.items()):
        return True
    return len(node.output) > 2 and bool(node.output[2])


def _subgraph_refs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from enclosing scopes."""
    defined = {x.name for x in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.name for t in graph.sparse_initializer}
    refs = set()
    for node in graph.node:
        for name in _node_reads(node):
            if name not in defined:
                refs.add(name)
        defined.update(node.output)
    for out in graph.output:
        if out.name not in defined:
            refs.add(out.name)
    return refs


def _node_reads(node: onnx.NodeProto) -> list[str]:
    """A node's inputs, explicit and implicit (outer-scope reads of its subgraphs)."""
    names = [n for n in node.input if n]
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            names.extend(sorted(_subgraph_refs(a.g)))
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                names.extend(sorted(_subgraph_refs(g)))
    return names


def _toposort(nodes, reads, graph_values):
    producer = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if out:
                producer[out] = i
    deps = [{producer[n] for n in r if n in producer and n not in graph_values} for r in reads]
    order, state = [], [0] * len(nodes)           # 0 new, 1 on the stack, 2 done

    def visit(i):
        stack = [(i, iter(sorted(deps[i])))]
        state[i] = 1
        while stack:
            j, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[j] = 2
                order.append(j)
            elif state[nxt] == 1:
                raise ContractError("model", "an acyclic graph", f"a cycle through node {nodes[nxt].name!r}")
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(deps[nxt]))))

    for i in range(len(nodes)):
        if state[i] == 0:
            visit(i)
    return order, producer


class _Segment:
    """Consecutive ORT work: a sub-model of the non-attention nodes of one stage."""

    def __init__(self, parent, nodes, inputs, initializers, outputs):
        self.parent, self.nodes = parent, nodes
        self.inputs, self.initializers, self.outputs = inputs, initializers, outputs
        self.sessions = {}

    def session(self, values):
        import onnxruntime as ort

        signature = tuple((v.dtype.str, v.ndim) for v in values)
        sess = self.sessions.get(signature)
        if sess is None:
            graph = helper.make_graph(
                self.nodes, f"{self.parent.graph_name}_part",
                [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), [None] * v.ndim)
                 for n, v in zip(self.inputs, values)],
                [onnx.ValueInfoProto(name=n) for n in self.outputs],   # ORT infers the types
                initializer=self.initializers,
            )
            model = helper.make_model(graph, opset_imports=self.parent.opset_import,
                                      ir_version=self.parent.ir_version, functions=self.parent.functions)
            sess = ort.InferenceSession(model.SerializeToString(), sess_options=self.parent.sess_options,
                                        providers=self.parent.providers)
            self.sessions[signature] = sess
        return sess

    def __call__(self, env):
        values = []
        for name in self.inputs:
            x = env[name]
            if not isinstance(x, np.ndarray):
                raise ContractError(name, "a tensor crossing a linear-attention cut", type(x).__name__)
            values.append(x)
        results = self.session(values).run(self.outputs, dict(zip(self.inputs, values)))
        env.update(zip(self.outputs, results))


class _Attention:
    """One linear-attention node, computed by deltarule."""

    def __init__(self, node, opset: int | None):
        self.node = node
        key = _key(node)
        self.key = key
        self.fn, n_out = LINEAR_ATTENTION_OPS[key] if key in LINEAR_ATTENTION_OPS else PARTIAL_OPS[key]
        where = f"node {node.name or node.op_type!r}"
        op = f"{node.domain or 'ai.onnx'}::{node.op_type}"
        if key == ("", "LinearAttention") and (opset is None or opset < LINEAR_ATTENTION_OPSET):
            raise ContractError("opset_import", f"ai.onnx opset >= {LINEAR_ATTENTION_OPSET} for {op} ({where}): "
                                "the op's first version", "no ai.onnx import" if opset is None else opset)
        extra = [o for o in node.output[n_out:] if o]
        if extra:
            raise ContractError(f"{where} outputs", f"at most {n_out} outputs ({op} defines {n_out})",
                                list(node.output))
        inputs, attributes, required = _CONTRACTS[key]
        if len(node.input) > len(inputs):
            raise ContractError(f"{where} inputs", f"at most {len(inputs)} inputs of {op} {tuple(inputs)}",
                                len(node.input))
        self.attrs = _ops.attribute_values(node)
        for name in self.attrs:
            if name not in attributes:
                raise ContractError(name, f"an attribute of {op} ({', '.join(attributes)})",
                                    f"an unknown attribute on {where}")
        for name in required:
            if name not in self.attrs:
                raise ContractError(name, f"a required attribute of {op}", f"absent on {where}")
        self.inputs = list(node.input)
        self.outputs = list(node.output)
        if key == _CONV and len(self.outputs) > 2 and self.outputs[2] \
                and self.attrs.get("state_update_capacity", 0) == 0:
            # the schema gives state_update a shape only for a positive capacity (ORT's CPU
            # kernel refuses the output; GatedDeltaNet's CPU kernel returns [N, 0] instead)
            raise ContractError("state_update_capacity", f"> 0 for a node with the state_update output ({where})",
                                0)

    def __call__(self, env):
        args = [env[n] if n else None for n in self.inputs]
        try:
            results = tuple(self.fn(*args, **self.attrs))
        except (ContractError, TypeError) as exc:
            exc.add_note(f"in {self.node.domain or 'ai.onnx'}::{self.node.op_type} node {self.node.name!r}")
            raise
        if len(results) == 2 and len(self.outputs) > 2 and self.outputs[2]:
            # GatedDeltaNet without capture (state_update_capacity 0): ORT returns [N, 0]
            results += (np.zeros((results[1].shape[0], 0), np.float32),)
        for name, x in zip(self.outputs, results):
            if name:
                env[name] = x


class Session:
    """A model whose linear-attention nodes run in deltarule and the rest in ONNX Runtime.

    Args:
        model: an onnx.ModelProto, serialized bytes or a path (an unreadable or truncated
            file, or bytes that do not parse: `ContractError` naming ``model``).
        providers: ORT execution providers (default ["CPUExecutionProvider"]).
        sess_options: an onnxruntime.SessionOptions for the sub-model sessions.

    Attributes:
        input_names, output_names: the graph's.
        inputs: the graph's declared inputs (`deltarule.onnx.feeds.Inputs`), read once.
        plan: the schedule, a list of ("ort", [node names]) and ("deltarule", node name).
    """

    def __init__(self, model, *, providers=None, sess_options=None):
        model = _feeds.load(model, "model")
        self.providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self.sess_options = sess_options
        graph = model.graph
        self.graph_name = graph.name or "graph"
        self.opset_import = list(model.opset_import)
        self.ir_version = model.ir_version
        self.functions = list(model.functions)
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        self.input_names = [x.name for x in graph.input]
        self.inputs = _feeds.Inputs.of_graph(graph)
        self.output_names = [x.name for x in graph.output]
        if graph.sparse_initializer:
            raise ContractError("model", "no sparse initializers in the top-level graph", "some")
        self._initializers = {t.name: t for t in graph.initializer}
        graph_inputs = set(self.input_names)
        graph_values = graph_inputs | set(self._initializers)

        nodes = list(graph.node)
        reads = [_node_reads(n) for n in nodes]
        order, producer = _toposort(nodes, reads, graph_values)
        is_la = [computed_by_deltarule(n) for n in nodes]
        stage = [0] * len(nodes)
        for i in order:
            for name in reads[i]:
                p = producer.get(name)
                if p is not None and name not in graph_values:
                    stage[i] = max(stage[i], stage[p] + is_la[p])

        readers: dict[str, set] = {}
        for i, r in enumerate(reads):
            for name in r:
                readers.setdefault(name, set()).add(i)
        outputs = set(self.output_names)

        self._steps = []
        self.plan = []
        for s in range(max(stage, default=-1) + 1):
            members = [i for i in order if stage[i] == s and not is_la[i]]
            member_set = set(members)
            produced = {o for i in members for o in nodes[i].output if o}
            seg_out = sorted(n for n in produced
                             if n in outputs or any(j not in member_set for j in readers.get(n, ())))
            if members and seg_out:
                seg_in, seg_init = [], []
                for i in members:
                    for name in reads[i]:
                        if name in produced or name in seg_in:
                            continue
                        if name in self._initializers and name not in graph_inputs:
                            if all(t.name != name for t in seg_init):
                                seg_init.append(self._initializers[name])
                        else:
                            seg_in.append(name)
                self._steps.append(_Segment(self, [nodes[i] for i in members], seg_in, seg_init, seg_out))
                self.plan.append(("ort", [nodes[i].name or nodes[i].op_type for i in members]))
            for i in order:
                if stage[i] == s and is_la[i]:
                    self._steps.append(_Attention(nodes[i], opset))
                    self.plan.append(("deltarule", nodes[i].name or nodes[i].op_type))
        # what a run can return: the values it holds at the end (checked before it runs)
        self._returnable = graph_values | {name for step in self._steps for name in step.outputs}

    def run(self, output_names, feeds: Mapping) -> list:
        """Outputs `output_names` (None: all, in graph order) as a list of arrays.

        `output_names` may also name values that cross a linear-attention cut
        (the inputs and outputs of the attention nodes). The feeds are checked against the
        graph's inputs first, as ONNX Runtime checks them (`deltarule.onnx.feeds`): a missing
        or unknown name, an element type, rank or static dimension other than the declared
        one raises `ContractError` naming the input before anything runs.
        """
        names = self.output_names if output_names is None else self._checked_names(output_names)
        env = _Values(self._initializers)
        env.update(self.inputs.check(feeds))
        for step in self._steps:
            step(env)
        return [env[n] for n in names]

    def _checked_names(self, output_names) -> list[str]:
        """`output_names` as a list of values a run holds, or ContractError (ONNX Runtime, too,
        refuses an unknown output name before it runs)."""
        if isinstance(output_names, (str, bytes)) or not isinstance(output_names, Iterable):
            raise ContractError("output_names", "None or a list of value names", repr(output_names))
        names = list(output_names)
        unknown = [n for n in names if n not in self._returnable]
        if unknown:
            raise ContractError("output_names", "names of the graph's outputs (or of values crossing a "
                                f"linear-attention cut; outputs {self.output_names})", repr(unknown[0]))
        return names


class _Values(dict):
    """The run's values; initializers are converted on first read."""

    def __init__(self, initializers):
        super().__init__()
        self._initializers = initializers

    def __missing__(self, name):
        if name in self._initializers:
            value = numpy_helper.to_array(self._initializers[name])
            self[name] = value
            return value
        raise ContractError(name, "a value computed before it is read", "missing")


def run(model, feeds: Mapping, output_names=None, *, providers=None, sess_options=None) -> list:
    """Run `model` once; returns the outputs (all, in graph order, or `output_names`) as a list.

    Linear-attention nodes (`LINEAR_ATTENTION_OPS`), and the `PARTIAL_OPS` nodes ONNX
    Runtime's CPU kernel refuses, are computed by deltarule, everything else by ONNX
    Runtime. Builds a `Session` each call: keep a `Session` to run a model more than once.
    """
    return Session(model, providers=providers, sess_options=sess_options).run(output_names, feeds)

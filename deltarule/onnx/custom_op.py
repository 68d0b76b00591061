"""`ai.deltarule::LinearAttention`: ONNX `LinearAttention`-27 plus Gated DeltaNet-2 gates.

ONNX `LinearAttention` (opset 27) cannot express Gated DeltaNet-2: its `beta`
is one scalar per head, used both as the erase and the write rate, and GDN-2
erases along the key channels (`b_t`, d_k wide) and writes along the value
channels (`w_t`, d_v wide). This module defines a custom-domain operator that
closes the gap, and ships it with an ONNX function body made of standard ops,
so any ONNX runtime can evaluate it.

The operator (domain "ai.deltarule", version 1, op type "LinearAttention"):

    inputs   query       (B, T, q_num_heads * d_k)
             key         (B, T, kv_num_heads * d_k)
             value       (B, T, kv_num_heads * d_v)
             past_state  optional (B, kv_num_heads, d_k, d_v), type S
             decay       optional (B, T, kv_num_heads) or (B, T, kv_num_heads * d_k), log space
             beta        optional (B, T, kv_num_heads) or (B, T, 1)
             erase_gate  optional (B, T, kv_num_heads * d_k)   (new)
             write_gate  optional (B, T, kv_num_heads * d_v)   (new)
    outputs  output        (B, T, q_num_heads * d_v), query's dtype
             present_state (B, kv_num_heads, d_k, d_v), past_state's dtype (query's when absent)
    attrs    q_num_heads, kv_num_heads (required), update_rule ("gated_delta"),
             scale (0.0 = 1 / sqrt(d_k)), chunk_size (64, a hint)

With neither gate it is exactly ONNX `LinearAttention`-27. `erase_gate` and
`write_gate` come together, replace `beta`, and are allowed for the delta
rules ("delta", "gated_delta") only. Per token and kv head, in float32:

    S' = diag(exp(decay_t)) S            (decay: one value per head, or per key channel)
    S  = S' + k_t (w_t * v_t - S'^T (b_t * k_t))^T
    o_t = scale * S^T q_t                (query head j reads state head j // (q_num_heads / kv_num_heads))

with b = w = beta for the beta form, b = 0 and w = 1 for "linear" / "gated".
`erase_gate = write_gate = beta` (broadcast over the channels) reproduces the
beta form exactly.

Function bodies. ONNX function bodies cannot branch on whether an optional
input is present, so there is one FunctionProto per *configuration*
(`Config`: update rule, whether past_state is given, and the gate form), told
apart by the IR-10 `overload` field of the node and the function. Inside a
configuration the body is generic: head counts and scale come in through
attribute references, sizes (B, T, d_k, d_v, per-head or per-key decay,
per-head or shared beta) from the input shapes. `make_node` sets the overload
for you; `attach_functions(model)` adds the bodies a model needs (and sets
overloads on nodes that lack them). Runtimes that ignore `overload` (ONNX's
`ReferenceEvaluator` as of onnx 1.23) evaluate a model correctly as long as
all its `ai.deltarule` nodes share one configuration.

`linear_attention(...)` is the same operator computed by deltarule (NumPy or
torch in and out), the kernel `deltarule.onnx.run` uses for these nodes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx.inliner
import torch
from onnx import TensorProto, helper

from ..api import call as _call
from ..contracts import onnx_linear_attention as _onnx_contract
from ..contracts._convert import Kind, dtype_name
from ..errors import ContractError

__all__ = [
    "DOMAIN", "OP_TYPE", "VERSION", "INPUTS", "OUTPUTS", "GATE_FORMS", "Config",
    "make_function", "make_node", "make_model", "attach_functions", "expand", "is_deltarule_node",
    "linear_attention",
]

DOMAIN = "ai.deltarule"
OP_TYPE = "LinearAttention"
VERSION = 1
INPUTS = ("query", "key", "value", "past_state", "decay", "beta", "erase_gate", "write_gate")
OUTPUTS = ("output", "present_state")
RULES = ("linear", "gated", "delta", "gated_delta")
GATED = ("gated", "gated_delta")
DELTA = ("delta", "gated_delta")
GATE_FORMS = ("none", "beta", "erase_write")
DEFAULTS = {"update_rule": "gated_delta", "scale": 0.0, "chunk_size": 64}
# every attribute of the op, with its ONNX type (a body references each with its type)
ATTRIBUTE_TYPES = {"q_num_heads": onnx.AttributeProto.INT, "kv_num_heads": onnx.AttributeProto.INT,
                   "update_rule": onnx.AttributeProto.STRING, "scale": onnx.AttributeProto.FLOAT,
                   "chunk_size": onnx.AttributeProto.INT}
REQUIRED_ATTRIBUTES = ("q_num_heads", "kv_num_heads")
MIN_OPSET = 15                                    # Shape(start, end) and CastLike
DEFAULT_OPSET = 21


# ---------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Config:
    """What shapes a function body: the rule, past_state's presence, the gate form.

    gates: "none" for "linear" / "gated"; "beta" or "erase_write" for
    "delta" / "gated_delta". `decay` is present exactly for the gated rules.
    """

    update_rule: str = "gated_delta"
    past_state: bool = False
    gates: str = "beta"

    def __post_init__(self):
        if self.update_rule not in RULES:
            raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(self.update_rule))
        if not isinstance(self.past_state, bool):
            raise ContractError("past_state", "a bool (whether the input is given)", repr(self.past_state))
        allowed = ("beta", "erase_write") if self.update_rule in DELTA else ("none",)
        if self.gates not in allowed:
            raise ContractError("gates", f"{' or '.join(map(repr, allowed))} for update_rule "
                                f"{self.update_rule!r}", repr(self.gates))

    @property
    def decay(self) -> bool:
        return self.update_rule in GATED

    @property
    def overload(self) -> str:
        """The FunctionProto / NodeProto overload naming this configuration."""
        return f"{self.update_rule}.{'past' if self.past_state else 'nopast'}.{self.gates}"

    @property
    def present(self) -> tuple[bool, ...]:
        """Which of INPUTS a node of this configuration gives."""
        return (True, True, True, self.past_state, self.decay, self.gates == "beta",
                self.gates == "erase_write", self.gates == "erase_write")

    @classmethod
    def of_node(cls, node: onnx.NodeProto) -> Config:
        """The configuration of an `ai.deltarule::LinearAttention` node (validated)."""
        names = list(node.input) + [""] * (len(INPUTS) - len(node.input))
        if len(node.input) > len(INPUTS):
            raise ContractError("inputs", f"at most {len(INPUTS)} inputs {INPUTS}", len(node.input))
        given = dict(zip(INPUTS, (bool(n) for n in names)))
        for name in INPUTS[:3]:
            if not given[name]:
                raise ContractError(name, "a required input", "absent")
        rule = DEFAULTS["update_rule"]
        for a in node.attribute:
            if a.name == "update_rule":
                rule = helper.get_attribute_value(a)
                rule = rule.decode() if isinstance(rule, bytes) else rule
        if rule not in RULES:
            raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(rule))
        if given["decay"] != (rule in GATED):
            raise ContractError("decay", f"{'given' if rule in GATED else 'absent'} for update_rule {rule!r}",
                                "given" if given["decay"] else "absent")
        if given["erase_gate"] != given["write_gate"]:
            missing = "write_gate" if given["erase_gate"] else "erase_gate"
            raise ContractError(missing, "erase_gate and write_gate together", "absent")
        if rule in DELTA:
            if given["beta"] and given["erase_gate"]:
                raise ContractError("beta", "absent when erase_gate / write_gate are given", "given")
            if not given["beta"] and not given["erase_gate"]:
                raise ContractError("beta", f"beta, or erase_gate and write_gate, for update_rule {rule!r}",
                                    "absent")
            gates = "beta" if given["beta"] else "erase_write"
        else:
            for name in ("beta", "erase_gate", "write_gate"):
                if given[name]:
                    raise ContractError(name, f"absent for update_rule {rule!r} (no retrieval)", "given")
            gates = "none"
        return cls(rule, given["past_state"], gates)


def is_deltarule_node(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type == OP_TYPE


# ---------------------------------------------------------------------------
# the function body
# ---------------------------------------------------------------------------

class _Builder:
    """Tiny node emitter with unique value names."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix
        self.count = 0

    def __call__(self, op, *inputs, n_out=1, name=None, **attrs):
        outs = []
        for i in range(n_out):
            self.count += 1
            outs.append(f"{self.prefix}{name or op.lower()}_{self.count}")
        self.nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def ints(self, *values):
        return self("Constant", value=helper.make_tensor("c", TensorProto.INT64, [len(values)], list(values)),
                    name="ints")

    def ref(self, op_attr: str, attr_type: int, func_attr: str):
        """A Constant whose `op_attr` references the function attribute `func_attr`."""
        self.count += 1
        out = f"{self.prefix}{func_attr}_{self.count}"
        node = helper.make_node("Constant", [], [out])
        a = node.attribute.add()
        a.name, a.type, a.ref_attr_name = op_attr, attr_type, func_attr
        self.nodes.append(node)
        return out


def make_function(config: Config | None = None, *, opset: int = DEFAULT_OPSET, **config_fields) -> onnx.FunctionProto:
    """The FunctionProto of `ai.deltarule::LinearAttention` for one configuration.

    Args:
        config: a `Config`, or give its fields as keywords (update_rule,
            past_state, gates).
        opset: the default-domain opset the body imports (>= 15); use the
            model's (`attach_functions` does).

    The body: cast to float32, split heads, exp(decay), b * k and w * v for
    every token at once, then a `Scan` over time whose body does one step
    (S' = a * S; S = S' + k (wv - S'^T bk)^T; o = S^T (scale q)) for all
    batch rows and heads at once; cast back. Attributes q_num_heads,
    kv_num_heads and scale are referenced, so one body serves every size.
    """
    if config is None:
        config = Config(**config_fields)
    elif config_fields:
        raise TypeError("give a Config or its fields, not both")
    opset = _onnx_contract.check_int_attr("opset", opset, minimum=MIN_OPSET)
    F = TensorProto.FLOAT
    nb = _Builder("")
    f32 = lambda x: nb("Cast", x, to=F, name="f32")
    delta, gated = config.update_rule in DELTA, config.decay

    hq = nb("Unsqueeze", nb.ref("value_int", onnx.AttributeProto.INT, "q_num_heads"), nb.ints(0))
    hkv = nb("Unsqueeze", nb.ref("value_int", onnx.AttributeProto.INT, "kv_num_heads"), nb.ints(0))
    scale_attr = nb.ref("value_float", onnx.AttributeProto.FLOAT, "scale")
    group = nb("Div", hq, hkv)
    zero2 = nb.ints(0, 0)
    batch = nb("Shape", "query", start=0, end=1)
    d_k = nb("Div", nb("Shape", "query", start=2, end=3), hq)
    d_v = nb("Div", nb("Shape", "value", start=2, end=3), hkv)

    def heads(x, width):                          # (B, T, H*w) -> (B, T, H, w) float32
        return nb("Reshape", f32(x), nb("Concat", zero2, hkv, width, axis=0))

    def time_major(x, rank):                      # (B, T, ...) -> (T, B, ...)
        return nb("Transpose", x, perm=[1, 0] + list(range(2, rank)))

    # scale: 0 selects 1 / sqrt(d_k); folded into q
    default_scale = nb("Reciprocal", nb("Sqrt", nb("Cast", d_k, to=F)))
    scale = nb("Where", nb("Equal", scale_attr, nb("Constant", value_float=0.0)), default_scale, scale_attr)
    q5 = nb("Reshape", f32("query"), nb("Concat", zero2, hkv, group, d_k, axis=0))     # B,T,H,G,dk
    q5 = nb("Mul", q5, scale)
    k4 = heads("key", d_k)                                                               # B,T,H,dk
    v4 = heads("value", d_v)                                                             # B,T,H,dv
    scans = [time_major(q5, 5), time_major(nb("Unsqueeze", k4, nb.ints(-1)), 5)]        # q, k column
    if gated:
        decay = nb("Exp", f32("decay"))
        width = nb("Div", nb("Shape", "decay", start=2, end=3), hkv)                     # 1 or d_k
        alpha = nb("Reshape", decay, nb("Concat", zero2, hkv, width, nb.ints(1), axis=0))  # B,T,H,1|dk,1
        scans.append(time_major(alpha, 5))
    if config.gates == "beta":
        erase = write = nb("Reshape", f32("beta"), nb.ints(0, 0, -1, 1))                 # B,T,H|1,1
    elif config.gates == "erase_write":
        erase, write = heads("erase_gate", d_k), heads("write_gate", d_v)
    if delta:
        bk = nb("Unsqueeze", nb("Mul", k4, erase), nb.ints(-2))                          # B,T,H,1,dk
        scans.append(time_major(bk, 5))
        wv = nb("Unsqueeze", nb("Mul", v4, write), nb.ints(-2))                          # B,T,H,1,dv
    else:
        wv = nb("Unsqueeze", v4, nb.ints(-2))
    scans.append(time_major(wv, 5))

    if config.past_state:
        state0 = f32("past_state")
    else:
        state0 = nb("ConstantOfShape", nb("Concat", batch, hkv, d_k, d_v, axis=0),
                    value=helper.make_tensor("zero", F, [1], [0.0]))

    # the Scan body: one token, all batch rows and heads
    bb = _Builder("s_")
    body_in = ["s_state", "s_q", "s_kcol"] + (["s_alpha"] if gated else []) + (["s_bk"] if delta else []) + ["s_wv"]
    s = bb("Mul", "s_state", "s_alpha") if gated else "s_state"
    u = bb("Sub", "s_wv", bb("MatMul", "s_bk", s)) if delta else "s_wv"
    new_state = bb("Add", s, bb("Mul", "s_kcol", u))
    bb.nodes.append(helper.make_node("Identity", [new_state], ["s_state_out"]))
    bb.nodes.append(helper.make_node("MatMul", ["s_q", "s_state_out"], ["s_o"]))
    body = helper.make_graph(
        bb.nodes, "linear_attention_step",
        [helper.make_tensor_value_info(n, F, [None] * 4) for n in body_in],   # all rank 4
        [helper.make_tensor_value_info("s_state_out", F, [None] * 4),
         helper.make_tensor_value_info("s_o", F, [None] * 4)],
    )
    final_state, o_tm = nb("Scan", state0, *scans, n_out=2, body=body, num_scan_inputs=len(scans))
    o = nb("Reshape", time_major(o_tm, 5), nb("Concat", zero2, nb("Mul", hq, d_v), axis=0))  # B,T,Hq*dv
    nb.nodes.append(helper.make_node("CastLike", [o, "query"], ["output"]))
    nb.nodes.append(helper.make_node(
        "CastLike", [final_state, "past_state" if config.past_state else "query"], ["present_state"]))

    last = max(i for i, p in enumerate(config.present) if p)
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS[: last + 1]), list(OUTPUTS), nb.nodes,
        [helper.make_opsetid("", opset)],
        attributes=["q_num_heads", "kv_num_heads"],
        attribute_protos=[helper.make_attribute(k, v) for k, v in DEFAULTS.items()],
        doc_string=f"ai.deltarule::LinearAttention, configuration {config.overload}",
        overload=config.overload,
    )


# ---------------------------------------------------------------------------
# nodes and models
# ---------------------------------------------------------------------------

def make_node(query: str, key: str, value: str, past_state: str | None = None, decay: str | None = None,
              beta: str | None = None, erase_gate: str | None = None, write_gate: str | None = None, *,
              q_num_heads: int, kv_num_heads: int, update_rule: str = "gated_delta", scale: float = 0.0,
              chunk_size: int = 64, outputs=OUTPUTS, name: str | None = None) -> onnx.NodeProto:
    """An `ai.deltarule::LinearAttention` node (value names; None = input absent).

    Every attribute is written out (ONNX's ReferenceEvaluator does not apply
    function attribute defaults) and `overload` names the node's `Config`.
    """
    attrs = check_attributes(q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, update_rule=update_rule,
                             scale=scale, chunk_size=chunk_size)
    names = [x or "" for x in (query, key, value, past_state, decay, beta, erase_gate, write_gate)]
    while not names[-1]:
        names.pop()
    node = helper.make_node(OP_TYPE, names, list(outputs), name=name, domain=DOMAIN, **attrs)
    node.overload = Config.of_node(node).overload
    return node


def check_attributes(*, q_num_heads, kv_num_heads, update_rule=DEFAULTS["update_rule"], scale=DEFAULTS["scale"],
                     chunk_size=DEFAULTS["chunk_size"]) -> dict:
    """The op's attribute values checked as `linear_attention` checks them (ContractError naming
    the attribute), as the node attributes they become (ints, a float, a string)."""
    Hq = _onnx_contract.check_int_attr("q_num_heads", q_num_heads, minimum=1)
    Hkv = _onnx_contract.check_int_attr("kv_num_heads", kv_num_heads, minimum=1)
    if Hq % Hkv:
        raise ContractError("q_num_heads", f"a positive multiple of kv_num_heads = {Hkv}", Hq)
    if not isinstance(update_rule, str) or update_rule not in RULES:
        raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(update_rule))
    _onnx_contract.check_scale(scale)
    chunk_size = _onnx_contract.check_int_attr("chunk_size", chunk_size)
    return dict(q_num_heads=Hq, kv_num_heads=Hkv, update_rule=update_rule, scale=float(scale), chunk_size=chunk_size)


def check_node_attributes(node: onnx.NodeProto) -> None:
    """An `ai.deltarule::LinearAttention` node's attributes: only the op's, each of its ONNX type,
    the required ones present, values as `check_attributes` wants (ContractError naming the
    attribute). A function body would otherwise reference an attribute that is not there."""
    where = f"node {node.name or node.op_type!r}"
    for a in node.attribute:
        if a.name not in ATTRIBUTE_TYPES:
            raise ContractError(a.name, f"an attribute of {DOMAIN}::{OP_TYPE} ({', '.join(ATTRIBUTE_TYPES)})",
                                f"an unknown attribute on {where}")
        if a.type != ATTRIBUTE_TYPES[a.name]:
            type_name = onnx.AttributeProto.AttributeType.Name
            raise ContractError(a.name, f"an attribute of type {type_name(ATTRIBUTE_TYPES[a.name])}",
                                f"{type_name(a.type)} on {where}")
    values = attribute_values(node)
    for required in REQUIRED_ATTRIBUTES:
        if required not in values:
            raise ContractError(required, f"a required attribute of {DOMAIN}::{OP_TYPE}", f"absent on {where}")
    check_attributes(**values)


def _walk_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _walk_nodes(g)


def attach_functions(model: onnx.ModelProto, *, opset: int | None = None) -> onnx.ModelProto:
    """A copy of `model` carrying the function body of every `ai.deltarule` node's configuration.

    Also: writes out defaulted attributes on those nodes, sets each node's
    `overload` to its configuration, imports domain "ai.deltarule" version 1
    and raises the IR version to >= 10 (overloads). The bodies import the
    model's default-domain opset (`opset` overrides; at least 15).
    """
    model = onnx.ModelProto.FromString(model.SerializeToString())
    if opset is None:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), DEFAULT_OPSET)
        opset = max(opset, MIN_OPSET)
    configs = {}
    for node in _walk_nodes(model.graph):
        if not is_deltarule_node(node):
            continue
        while node.input and not node.input[-1]:   # trailing absent inputs: the body's formals end earlier
            node.input.pop()
        have = {a.name for a in node.attribute}
        for k, v in DEFAULTS.items():
            if k not in have:
                node.attribute.append(helper.make_attribute(k, v))
        check_node_attributes(node)
        config = Config.of_node(node)
        node.overload = config.overload
        configs[config.overload] = config
    keep = [f for f in model.functions
            if not (f.domain == DOMAIN and f.name == OP_TYPE and f.overload in configs)]
    del model.functions[:]
    model.functions.extend(keep + [make_function(c, opset=opset) for c in configs.values()])
    if configs and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
    model.ir_version = max(model.ir_version, 10)
    return model


def expand(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every `ai.deltarule::LinearAttention` node replaced by its function body.

    The result uses standard ops only (plus whatever else the model uses), so
    it runs where model-local functions or overloads are not supported, e.g.
    in ONNX's ReferenceEvaluator with several configurations in one model.
    Bodies are attached first (`attach_functions`); onnx's inliner honours
    the overloads. Needs T >= 1 like the body itself.
    """
    model = attach_functions(model)
    return onnx.inliner.inline_selected_functions(model, [(DOMAIN, OP_TYPE)], exclude=False)


_TORCH_ELEM = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
    torch.float64: TensorProto.DOUBLE, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64,
}


def _elem_type(x) -> int:
    if isinstance(x, torch.Tensor):
        return _TORCH_ELEM[x.dtype]
    return helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype)


def make_model(feeds: dict, *, q_num_heads: int, kv_num_heads: int, update_rule: str = "gated_delta",
               scale: float = 0.0, chunk_size: int = 64, opset: int = 27, with_function: bool = True
               ) -> onnx.ModelProto:
    """A one-node model of `ai.deltarule::LinearAttention` for these feeds.

    feeds: {input name in INPUTS: array}; the given names become graph inputs
    with the arrays' dtypes and ranks (all dimensions dynamic). Outputs
    "output" and "present_state". with_function=True attaches the body
    (otherwise only `deltarule.onnx.run` can evaluate the model).
    """
    unknown = set(feeds) - set(INPUTS)
    if unknown:
        raise ContractError("feeds", f"names among {INPUTS}", sorted(unknown))
    node = make_node(*(n if n in feeds else None for n in INPUTS), q_num_heads=q_num_heads,
                     kv_num_heads=kv_num_heads, update_rule=update_rule, scale=scale, chunk_size=chunk_size)
    q_type = _elem_type(feeds["query"])
    s_type = _elem_type(feeds["past_state"]) if "past_state" in feeds else q_type
    graph = helper.make_graph(
        [node], "deltarule_linear_attention",
        [helper.make_tensor_value_info(n, _elem_type(feeds[n]), [None] * np.ndim(feeds[n]))
         for n in INPUTS if n in feeds],
        [helper.make_tensor_value_info("output", q_type, [None] * 3),
         helper.make_tensor_value_info("present_state", s_type, [None] * 4)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(DOMAIN, VERSION)], ir_version=10)
    return attach_functions(model) if with_function else model


# ---------------------------------------------------------------------------
# the operator computed by deltarule
# ---------------------------------------------------------------------------

def linear_attention(query, key, value, past_state=None, decay=None, beta=None, erase_gate=None,
                     write_gate=None, *, q_num_heads: int, kv_num_heads: int,
                     update_rule: str = "gated_delta", scale: float = 0.0, chunk_size: int = 64):
    """`ai.deltarule::LinearAttention` by deltarule: returns (output, present_state).

    Without erase_gate / write_gate this is `deltarule.contracts.onnx_linear_attention.linear_attention`
    (ONNX LinearAttention-27 exactly). With them (delta rules only, beta
    absent): erase_gate (B, T, kv_num_heads * d_k) and write_gate
    (B, T, kv_num_heads * d_v) in query's dtype, the rest as in opset 27.
    NumPy in, NumPy out; torch in, torch out. Invalid calls raise
    `deltarule.ContractError` naming the input or attribute.
    """
    if erase_gate is None and write_gate is None:
        return _onnx_contract.linear_attention(
            query, key, value, past_state, decay, beta, q_num_heads=q_num_heads, kv_num_heads=kv_num_heads,
            update_rule=update_rule, scale=scale, chunk_size=chunk_size)

    kind = Kind("query", query)
    q = kind.tensor("query", query, optional=False)
    k = kind.tensor("key", key, optional=False)
    v = kind.tensor("value", value, optional=False)
    e = kind.tensor("erase_gate", erase_gate)
    w = kind.tensor("write_gate", write_gate)
    if not isinstance(update_rule, str) or update_rule not in RULES:
        raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(update_rule))
    if update_rule not in DELTA:
        raise ContractError("erase_gate" if e is not None else "write_gate",
                            f"absent for update_rule {update_rule!r} (no retrieval)", "a tensor")
    if e is None or w is None:
        missing = "erase_gate" if e is None else "write_gate"
        raise ContractError(missing, "erase_gate and write_gate together", "absent")
    if beta is not None:
        raise ContractError("beta", "absent when erase_gate / write_gate are given", "a tensor")
    Hq = _onnx_contract.check_int_attr("q_num_heads", q_num_heads, minimum=1)
    Hkv = _onnx_contract.check_int_attr("kv_num_heads", kv_num_heads, minimum=1)
    if Hq % Hkv:
        raise ContractError("q_num_heads", f"a positive multiple of kv_num_heads = {Hkv}", Hq)
    _onnx_contract.check_int_attr("chunk_size", chunk_size)
    scale = _onnx_contract.check_scale(scale)
    gated = update_rule in GATED
    d = kind.tensor("decay", decay)
    if gated and d is None:
        raise ContractError("decay", f"an input for update_rule {update_rule!r}", "absent")
    if not gated and d is not None:
        raise ContractError("decay", f"absent for update_rule {update_rule!r}", "a tensor")

    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dim() != 3:
            raise ContractError(name, "a rank-3 tensor (B, T, H*D)", f"shape {list(x.shape)}")
    if q.dtype not in _onnx_contract.FLOAT_DTYPES:
        raise ContractError("query", "dtype float32, float16 or bfloat16 (type T)", dtype_name(q.dtype))
    for name, x in (("key", k), ("value", v), ("decay", d), ("erase_gate", e), ("write_gate", w)):
        if x is not None and x.dtype != q.dtype:
            raise ContractError(name, f"query's dtype {dtype_name(q.dtype)} (type T)", dtype_name(x.dtype))
        if x is not None and x.device != q.device:
            raise ContractError(name, f"device {q.device} (query's)", x.device)
    B, T, q_width = q.shape
    if q_width == 0 or q_width % Hq:
        raise ContractError("query", f"last axis a positive multiple of q_num_heads = {Hq}", q_width)
    d_k = q_width // Hq
    if tuple(k.shape) != (B, T, Hkv * d_k):
        raise ContractError("key", f"(B, T, kv_num_heads * d_k) = ({B}, {T}, {Hkv * d_k})",
                            f"shape {list(k.shape)}")
    if tuple(v.shape[:2]) != (B, T) or v.shape[2] == 0 or v.shape[2] % Hkv:
        raise ContractError("value", f"(B, T, kv_num_heads * d_v) = ({B}, {T}, {Hkv} * d_v), d_v >= 1",
                            f"shape {list(v.shape)}")
    d_v = v.shape[2] // Hkv
    if tuple(e.shape) != (B, T, Hkv * d_k):
        raise ContractError("erase_gate", f"(B, T, kv_num_heads * d_k) = ({B}, {T}, {Hkv * d_k})",
                            f"shape {list(e.shape)}")
    if tuple(w.shape) != (B, T, Hkv * d_v):
        raise ContractError("write_gate", f"(B, T, kv_num_heads * d_v) = ({B}, {T}, {Hkv * d_v})",
                            f"shape {list(w.shape)}")
    g = gk = None
    if d is not None:
        if d.dim() != 3 or tuple(d.shape[:2]) != (B, T) or d.shape[2] not in (Hkv, Hkv * d_k):
            raise ContractError("decay", f"(B, T, kv_num_heads) = ({B}, {T}, {Hkv}) or "
                                f"(B, T, kv_num_heads * d_k) = ({B}, {T}, {Hkv * d_k})", f"shape {list(d.shape)}")
        g, gk = (d, None) if d.shape[2] == Hkv else (None, d.reshape(B, T, Hkv, d_k))

    s, state_dtype = _onnx_contract.past_state_of(kind, past_state, q, B, Hkv, d_k, d_v)

    o, state = _call(
        q.reshape(B, T, Hq, d_k), k.reshape(B, T, Hkv, d_k), v.reshape(B, T, Hkv, d_v), rule=update_rule,
        g=g, gk=gk, erase=e.reshape(B, T, Hkv, d_k), write=w.reshape(B, T, Hkv, d_v), scale=scale,
        initial_state=s, chunk_size=chunk_size if chunk_size >= 1 else 64,
        accept_growth=True,  # the runtime takes any log decay; linear_attention refuses > 0
    )
    return kind.out(o.reshape(B, T, Hq * d_v)), kind.out(state.to(state_dtype))


def attribute_values(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values (strings decoded)."""
    out = {}
    for a in node.attribute:
        x = helper.get_attribute_value(a)
        out[a.name] = x.decode() if isinstance(x, bytes) else x
    return out


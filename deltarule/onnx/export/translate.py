"""What deltarule's torch ops become in ONNX (`torch.onnx`'s ``custom_translation_table``).

- ``deltarule::linear_attention`` -> one ``LinearAttention`` node, packed [B, T, H * D]
  operands with the heads unpacked around it. The L2 norm of q and k (``qk_l2norm``: x /
  sqrt(sum(x^2) + eps), deltarule's and fla's, in float32), the sigmoid of ``beta_sigmoid``
  and the head repeat of GVA (query and key heads repeated to the value heads, as deltarule
  reads them) are standard ops before it; the decay is ``g`` [B, T, H] or ``gk`` reshaped
  to [B, T, H * K] (KDA's per-key decay).
  A Gated DeltaNet-2 call (``erase`` / ``write`` gates) becomes ``ai.deltarule::LinearAttention``
  (`deltarule.onnx.custom_op`: ONNX LinearAttention plus the two gates, with an ONNX function body
  of standard ops, so every runtime runs it).
- ``deltarule::linear_attention`` for target ``"ort-gpu"`` -> one ``com.microsoft.GatedDeltaNet``
  node (`gated_delta_net`): rank-4 [B, T, H, D] q / k / v as they are (no packing, no head
  repeat: value heads a multiple of query heads is the node's own form; GQA has none and is
  refused), the L2 norm (``qk_l2_norm=1``, eps 1e-12), the sigmoid of ``beta_sigmoid``
  (``beta_activation``) and the raw-gate arm with per-head ``A_log`` / ``dt_bias``
  (``gate_activation="qwen"``) fused into it; a V-major state. Gated DeltaNet-2 calls keep
  ``ai.deltarule::LinearAttention``.
- ``deltarule::causal_conv1d_with_state`` -> one ``CausalConvWithState`` node.

They are emitted as placeholder ops (`PLACEHOLDERS`, domain `PLACEHOLDER`, schemas registered
here: the targets' common form), which `deltarule.onnx.export.graph` renames into the target's
domain: ONNX's own (opset 27) or ONNX Runtime's ``com.microsoft`` (``ai.deltarule`` for
Gated DeltaNet-2 on both). A call these nodes cannot express (a slab, packed sequences, a
fused gate) raises `deltarule.Unsupported` naming the argument while the model is exported.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import onnx
from onnx.defs import OpSchema

from ...errors import Unsupported

PLACEHOLDER = "ai.deltarule.onnx.export"
# placeholder -> (domain, op) it becomes; domain None: the target's (`graph.TARGETS`). Names
# unique across domains: onnx.reference requires it.
PLACEHOLDERS = {"ExportedLinearAttention": (None, "LinearAttention"),
                "ExportedCausalConvWithState": (None, "CausalConvWithState"),
                "ExportedGatedDeltaNet2": ("ai.deltarule", "LinearAttention"),
                "ExportedGatedDeltaNet": ("com.microsoft", "GatedDeltaNet")}
# the targets whose linear-attention node is com.microsoft.GatedDeltaNet (`gated_delta_net`)
GATED_DELTA_NET_TARGETS = ("ort-gpu",)
# GatedDeltaNet's chunk_size: a scheduling hint that never changes the result. 16 opts into
# WebGPU's chunkwise prefill (onnxruntime/contrib_ops/webgpu/bert/gated_delta_net.cc: chunk_size
# == kDeltaPrefillChunkSize = 16); on CUDA only 32 means something (it pins the narrow chunk:
# contrib_ops/cuda/bert/gated_delta_net_plan.h), any other value takes the widest chunk that fits
GATED_DELTA_NET_CHUNK_SIZE = 16
# GatedDeltaNet's in-op L2 norm: x * rsqrt(sum(x^2) + 1e-12)
GATED_DELTA_NET_L2NORM_EPS = 1e-12
_REFUSED = {
    "cu_seqlens": "packed sequences (cu_seqlens)", "seq_lens": "ragged sequences (seq_lens)",
    "state_indices": "a state slab (state_indices)", "num_accepted_tokens": "speculative rows",
    "plan_layout": "a batch plan",
}
_FLOAT = onnx.TensorProto.FLOAT
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_TYPES = {"TI": ["tensor(int32)"]}         # a type constraint's allowed types (default _FLOATS)


def _schema(name, inputs, outputs, attributes, types):
    param = OpSchema.FormalParameter
    return OpSchema(
        name, PLACEHOLDER, 1, inputs=[param(n, t, "", param_option=OpSchema.FormalParameterOption.Optional if opt
                                            else OpSchema.FormalParameterOption.Single) for n, t, opt in inputs],
        outputs=[param(n, t) for n, t in outputs],
        type_constraints=[(t, _TYPES.get(t, _FLOATS), "") for t in types],
        attributes=[OpSchema.Attribute(a, kind, "", required=False) for a, kind in attributes])


_LINEAR_ATTRIBUTES = [("q_num_heads", OpSchema.AttrType.INT), ("kv_num_heads", OpSchema.AttrType.INT),
                      ("update_rule", OpSchema.AttrType.STRING), ("scale", OpSchema.AttrType.FLOAT)]
_SCHEMAS = (
    _schema("ExportedLinearAttention",
            [("query", "T", False), ("key", "T", False), ("value", "T", False), ("past_state", "S", True),
             ("decay", "T", True), ("beta", "T", True)],
            [("output", "T"), ("present_state", "S")], _LINEAR_ATTRIBUTES, ("T", "S")),
    # ai.deltarule::LinearAttention (deltarule.onnx.custom_op): Gated DeltaNet-2's erase / write gates
    _schema("ExportedGatedDeltaNet2",
            [("query", "T", False), ("key", "T", False), ("value", "T", False), ("past_state", "S", True),
             ("decay", "T", True), ("beta", "T", True), ("erase_gate", "T", True), ("write_gate", "T", True)],
            [("output", "T"), ("present_state", "S")], _LINEAR_ATTRIBUTES, ("T", "S")),
    # com.microsoft.GatedDeltaNet (target "ort-gpu"): its inputs in its order, the two outputs used
    _schema("ExportedGatedDeltaNet",
            [("query", "T", False), ("key", "T", False), ("value", "T", False), ("cu_seqlens", "TI", True),
             ("decay", "S", True), ("beta", "S", True), ("initial_state", "S", True), ("a_log", "S", True),
             ("dt_bias", "S", True)],
            [("output", "T"), ("final_state", "S")],
            [("update_rule", OpSchema.AttrType.STRING), ("scale", OpSchema.AttrType.FLOAT),
             ("qk_l2_norm", OpSchema.AttrType.INT), ("beta_activation", OpSchema.AttrType.STRING),
             ("gate_activation", OpSchema.AttrType.STRING), ("chunk_size", OpSchema.AttrType.INT)],
            ("T", "S", "TI")),
    _schema("ExportedCausalConvWithState",
            [("input", "T", False), ("weight", "T", False), ("bias", "T", True), ("past_state", "T", True)],
            [("output", "T"), ("present_state", "T")], [("activation", OpSchema.AttrType.STRING)], ("T",)),
)


def register_schemas() -> None:
    """Register the placeholder ops' schemas with onnx (torch.onnx's tracer needs them); idempotent."""
    for schema in _SCHEMAS:
        try:
            onnx.defs.get_schema(schema.name, 1, PLACEHOLDER)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(schema)


def translation_table(target: str = "ort") -> dict:
    """torch.onnx's ``custom_translation_table`` for deltarule's ops, for `target`
    (`deltarule.onnx.export.graph.TARGETS`): its linear-attention node is LinearAttention, or
    com.microsoft.GatedDeltaNet for `GATED_DELTA_NET_TARGETS`."""
    import torch
    register_schemas()
    return {torch.ops.deltarule.linear_attention.default: _for_target(target),
            torch.ops.deltarule.causal_conv1d_with_state.default: causal_conv1d_with_state}


def _for_target(target: str):
    """`linear_attention` with its `target` bound, keeping the op's signature (torch.onnx reads
    it to bind the call's arguments)."""
    signature = inspect.signature(linear_attention)

    @functools.wraps(linear_attention)
    def translation(*args, **kwargs):
        return linear_attention(*args, **kwargs, target=target)
    translation.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name != "target"])
    return translation


def refusal(call: dict, target: str = "ort") -> str | None:
    """Why a ``deltarule::linear_attention`` call (its arguments by name: tensors, or
    torch.export's nodes carrying them as ``meta["val"]``) has no node of `target`, or None.
    Every other argument of the record has an exact translation (`linear_attention`)."""
    node = "GatedDeltaNet" if target in GATED_DELTA_NET_TARGETS else "LinearAttention"
    for name, what in _REFUSED.items():
        if call.get(name) is not None:
            return f"{what} has no {node} node"
    if target in GATED_DELTA_NET_TARGETS and call.get("erase") is None:
        Hq, Hk, Hv = (_heads(call.get(name)) for name in ("q", "k", "v"))
        if None not in (Hq, Hk, Hv) and Hq != Hk:
            return (f"GQA (query heads Hq = {Hq} above key / value heads Hk = {Hk}, Hv = {Hv}) has no "
                    f"com.microsoft.GatedDeltaNet node (target {target!r}: its value heads are a multiple "
                    f"of its query heads, which equal its key heads); export with target 'ort' or 'onnx'")
    return None


def _heads(x) -> int | None:
    """The head count (axis 2) of a [B, T, H, D] tensor, or of the value a torch.export node
    carries; None when not known statically."""
    x = getattr(x, "meta", {}).get("val", x) if not hasattr(x, "shape") else x
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
        return None
    return shape[2] if isinstance(shape[2], int) else None


def _ops():
    from onnxscript import opset18 as op
    from onnxscript.values import Opset
    return op, Opset(PLACEHOLDER, 1)


def _shape(x) -> list:
    return [d if isinstance(d, int) else None for d in x.shape]


def _ints(op, values):
    return op.Constant(value=onnx.helper.make_tensor("c", onnx.TensorProto.INT64, [len(values)], values))


def _float(op, x):
    """x in float32 (exact from float16 / bfloat16), or None."""
    if x is None or int(x.dtype) == _FLOAT:
        return x
    return op.Cast(x, to=_FLOAT)


def _cast(op, x, dtype: int):
    """x (float32) stored as `dtype`: ONNX's Cast rounds to nearest even, as deltarule's stores do."""
    return x if dtype == _FLOAT else op.Cast(x, to=dtype)


def _repeat_heads(op, x, r: int):
    """[B, T, H, D] -> packed [B, T, H * r * D], head h repeated r times in place (h * r .. h * r + r - 1)."""
    if r == 1:
        return op.Reshape(x, _ints(op, [0, 0, -1]))
    x = op.Unsqueeze(x, _ints(op, [3]))
    x = op.Expand(x, _ints(op, [1, 1, 1, r, 1]))
    return op.Reshape(x, _ints(op, [0, 0, -1]))


def _l2norm(op, x, eps: float):
    """x / sqrt(sum(x^2, -1) + eps) (x float32)."""
    s = op.ReduceSumSquare(x, _ints(op, [-1]), keepdims=1)
    return op.Div(x, op.Sqrt(op.Add(s, op.Constant(value=onnx.helper.make_tensor("e", _FLOAT, [], [eps])))))


def _decay(op, g, gk, A_log, dt_bias, packed: bool = True):
    """The log decay the node takes, float32: [B, T, H] (scalar) or [B, T, H * K] (per key;
    [B, T, H, K] without `packed`);
    the raw-gate arm ``-exp(A_log) * softplus(gate + dt_bias)`` and g with gk (the per-key
    decay exp(gk + g)) computed before it, as the kernels do. None without decay."""
    g, gk = _float(op, g), _float(op, gk)
    if A_log is not None:
        rate = op.Neg(op.Exp(_float(op, A_log)))                  # [H]
        if g is not None:
            g = op.Mul(rate, op.Softplus(op.Add(g, _float(op, dt_bias))))
        else:                                                     # dt_bias [H, K]
            gk = op.Mul(op.Unsqueeze(rate, _ints(op, [1])), op.Softplus(op.Add(gk, _float(op, dt_bias))))
    if gk is None:
        return g
    if g is not None:
        gk = op.Add(gk, op.Unsqueeze(g, _ints(op, [3])))
    return op.Reshape(gk, _ints(op, [0, 0, -1])) if packed else gk


def _rates(op, beta, erase, write, sigmoid: bool):
    """beta [B, T, H], erase [B, T, H * K], write [B, T, H * V] in float32 (each None when
    absent), the sigmoid applied to every one of them with `sigmoid` (``beta_sigmoid``)."""
    rates = []
    for x, packed in ((beta, False), (erase, True), (write, True)):
        x = _float(op, x)
        if x is not None and sigmoid:
            x = op.Sigmoid(x)
        if x is not None and packed:
            x = op.Reshape(x, _ints(op, [0, 0, -1]))
        rates.append(x)
    return rates


def _scale(scale, K: int) -> float:
    """The scale as the kernels apply it: float32 (a scale float32 rounds to 0 is 0)."""
    return float(np.float32(K ** -0.5 if scale is None else scale))


def linear_attention(q, k, v, rule="gated_delta", g=None, gk=None, beta=None, erase=None, write=None, scale=None,
                     initial_state=None, state_layout="kv", cu_seqlens=None, seq_lens=None, state_indices=None,
                     num_accepted_tokens=None, plan_cu_seqlens=None, plan_seq_lens=None, plan_state_indices=None,
                     plan_num_accepted_tokens=None, plan_layout=None, plan_device=None, qk_l2norm=False,
                     l2norm_eps=1e-6, A_log=None, dt_bias=None, beta_sigmoid=False, chunk_size=64, backend="auto",
                     accept_growth=False, num_states=None, *, target="ort"):
    """``deltarule::linear_attention`` (the record's arguments, `deltarule.arguments`) as a
    ``LinearAttention`` node (a ``GatedDeltaNet`` node for `GATED_DELTA_NET_TARGETS`:
    `gated_delta_net`): returns (o [B, T, max(Hq, Hv), V] in v's dtype, the state
    [B, Hv, K, V] ([B, Hv, V, K] for ``state_layout="vk"``) in initial_state's dtype, float32
    without one).

    The node computes in float32, as every deltarule kernel does: 16-bit operands and state are
    cast up (exactly) before it and the output and state rounded to their dtypes after it, so
    the graph equals the eager call for every dtype mix the call accepts. `chunk_size`,
    `backend` and `accept_growth` do not change the result."""
    reason = refusal(dict(cu_seqlens=cu_seqlens, seq_lens=seq_lens, state_indices=state_indices,
                          num_accepted_tokens=num_accepted_tokens, plan_layout=plan_layout, q=q, k=k, v=v,
                          erase=erase), target)
    if reason:
        raise Unsupported(f"deltarule::linear_attention: {reason}")
    if target in GATED_DELTA_NET_TARGETS and erase is None:
        return gated_delta_net(q, k, v, rule=rule, g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state,
                               state_layout=state_layout, qk_l2norm=qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                               beta_sigmoid=beta_sigmoid)
    op, ph = _ops()
    B, T, Hq, K = _shape(q)
    Hk, Hv, V = _shape(k)[2], _shape(v)[2], _shape(v)[3]
    if None in (Hq, K, Hk, Hv, V):
        raise Unsupported("deltarule::linear_attention: head counts and sizes must be static to export")
    out_dtype = int(v.dtype)
    q, k, v = _float(op, q), _float(op, k), _float(op, v)
    if qk_l2norm:
        q, k = _l2norm(op, q, l2norm_eps), _l2norm(op, k, l2norm_eps)
    H = max(Hq, Hv)
    # deltarule's head forms: GVA (Hq == Hk, Hv a multiple), GQA (Hk == Hv, Hq a multiple);
    # the nodes get query and key at H / r_q and kv at H = Hv or Hq (standard: q heads a multiple of kv)
    q_packed = _repeat_heads(op, q, Hv // Hq if Hv > Hq else 1)
    k_packed = _repeat_heads(op, k, Hv // Hk)
    v_packed = op.Reshape(v, _ints(op, [0, 0, -1]))
    decay = _decay(op, g, gk, A_log, dt_bias)
    beta, erase, write = _rates(op, beta, erase, write, beta_sigmoid)
    state_dtype = _FLOAT if initial_state is None else int(initial_state.dtype)
    past = _float(op, initial_state)
    if past is not None and state_layout == "vk":                 # the nodes' state is [B, H, K, V]
        past = op.Transpose(past, perm=[0, 1, 3, 2])
    scale = _scale(scale, K)
    # the nodes read scale 0 as "the default 1 / sqrt(d_k)": a zero scale is scale 1 times 0
    attributes = dict(q_num_heads=H if Hv > Hq else Hq, kv_num_heads=Hv, update_rule=rule, scale=scale or 1.0)
    operands = [q_packed, k_packed, v_packed, past, decay if rule in ("gated", "gated_delta") else None,
                beta if rule in ("delta", "gated_delta") else None]
    if erase is None:
        o, state = ph.ExportedLinearAttention(*operands, **attributes)
    else:                                                  # Gated DeltaNet-2: ai.deltarule::LinearAttention
        o, state = ph.ExportedGatedDeltaNet2(*operands, erase, write, **attributes)
    if scale == 0.0:
        o = op.Mul(o, op.Constant(value=onnx.helper.make_tensor("zero", _FLOAT, [], [0.0])))
    o = op.Reshape(_cast(op, o, out_dtype), op.Concat(op.Shape(v, start=0, end=2), _ints(op, [H, V]), axis=0))
    if state_layout == "vk":
        state = op.Transpose(state, perm=[0, 1, 3, 2])
    if initial_state is None:               # (a type for the graph: the node's S comes from past_state)
        return o, op.Cast(state, to=_FLOAT)
    return o, _cast(op, state, state_dtype)


def gated_delta_net(q, k, v, *, rule, g, gk, beta, scale, initial_state, state_layout, qk_l2norm, A_log, dt_bias,
                    beta_sigmoid):
    """A ``deltarule::linear_attention`` call without Gated DeltaNet-2 gates and with Hq == Hk
    (`refusal` refuses GQA) as one ``com.microsoft.GatedDeltaNet`` node: returns (o [B, T, Hv, V]
    in v's dtype, the state in initial_state's dtype (float32 without one) and the call's layout).

    Rank-4 [B, T, H, D] query / key / value go in as they are: float16 stays float16 (the node's
    T; it computes in float32), anything else is float32 (bfloat16 too: WebGPU's kernel has no
    bfloat16). decay, beta, the state, a_log and dt_bias are float32 (the WebGPU card's types;
    ONNX Runtime's earlier CUDA kernel reads decay and beta as float32 whatever T is). Fused:
    ``qk_l2norm`` (``qk_l2_norm=1``: eps 1e-12, not the call's `l2norm_eps`: the relative
    change of a normalized vector is about (l2norm_eps - 1e-12) / (2 |x|^2)), ``beta_sigmoid``
    (``beta_activation="sigmoid"``) and the raw-gate arm with ``g`` (``gate_activation="qwen"``,
    ONNX Runtime's name for -exp(a_log) * softplus(decay + dt_bias) that CPU, CUDA and WebGPU
    all accept; ``"softplus"`` is CPU's alone). Per-key decay (``gk``, with ``g`` added, or its
    raw-gate arm computed before the node) is decay [B, T, H, K]."""
    op, ph = _ops()
    Hq, K, Hv, V = _shape(q)[2], _shape(q)[3], _shape(v)[2], _shape(v)[3]
    if None in (Hq, K, Hv, V):
        raise Unsupported("deltarule::linear_attention: head counts and sizes must be static to export")
    out_dtype = int(v.dtype)
    node_dtype = onnx.TensorProto.FLOAT16 if {int(x.dtype) for x in (q, k, v)} == {onnx.TensorProto.FLOAT16} \
        else _FLOAT
    if node_dtype == _FLOAT:
        q, k, v = _float(op, q), _float(op, k), _float(op, v)
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    decay = a_log = bias = None
    gate = "none"
    if gating:
        if A_log is not None and g is not None:              # the raw-gate arm, per head: fused
            decay, a_log, bias, gate = _float(op, g), _float(op, A_log), _float(op, dt_bias), "qwen"
        else:                                                  # g [B, T, H], or per key [B, T, H, K]
            decay = _decay(op, g, gk, A_log, dt_bias, packed=False)
    beta = _float(op, beta) if delta else None
    state_dtype = _FLOAT if initial_state is None else int(initial_state.dtype)
    past = _float(op, initial_state)
    if past is not None and state_layout == "kv":              # the node's state is V-major
        past = op.Transpose(past, perm=[0, 1, 3, 2])
    scale = _scale(scale, K)
    o, state = ph.ExportedGatedDeltaNet(
        q, k, v, None, decay, beta, past, a_log, bias, update_rule=rule, scale=scale or 1.0,
        qk_l2_norm=int(bool(qk_l2norm)), beta_activation="sigmoid" if beta_sigmoid and delta else "none",
        gate_activation=gate, chunk_size=GATED_DELTA_NET_CHUNK_SIZE)
    if scale == 0.0:                     # the node reads scale 0 as 1 / sqrt(d_k): scale 1 times 0
        o = op.Mul(o, op.Constant(value=onnx.helper.make_tensor("zero", node_dtype, [], [0.0])))
    o = o if node_dtype == out_dtype else op.Cast(o, to=out_dtype)
    if state_layout == "kv":
        state = op.Transpose(state, perm=[0, 1, 3, 2])
    if initial_state is None:
        return o, op.Cast(state, to=_FLOAT)
    return o, _cast(op, state, state_dtype)


def causal_conv1d_with_state(x, weight, bias=None, state=None, activation=None):
    """``deltarule::causal_conv1d_with_state`` as a ``CausalConvWithState`` node: (y in x's dtype,
    new state in state's dtype (x's without one)). The node computes in float32, as the eager
    call does: a float32 state beside a 16-bit x keeps its precision."""
    op, ph = _ops()
    x_dtype = int(x.dtype)
    state_dtype = x_dtype if state is None else int(state.dtype)
    w = op.Unsqueeze(_float(op, weight), _ints(op, [1]))      # [C, W] -> [C, 1, W]
    y, present = ph.ExportedCausalConvWithState(_float(op, x), w, _float(op, bias), _float(op, state),
                                                activation="silu" if activation == "silu" else "none")
    return _cast(op, y, x_dtype), _cast(op, present, state_dtype)

"""ONNX Runtime's contrib operators (domain `com.microsoft`) on top of deltarule.

- `gated_delta_net`: `com.microsoft.GatedDeltaNet` — token-major (T, H, D) with
  optional `cu_seqlens`, or (B, S, H, D); V-major float32 state
  (B, H_v, d_v, d_k); value heads a multiple of query heads; fused gate
  (`gate_activation`), beta sigmoid and in-kernel L2 norm (eps 1e-12).
- `linear_attention`: `com.microsoft.LinearAttention` — ONNX `LinearAttention`
  plus inverse GQA (kv_num_heads a multiple of q_num_heads) and a key with any
  head count dividing kv_num_heads.
- `linear_attention_gate`: `com.microsoft.LinearAttentionGate` — the fused
  gate `decay = decay_scale * softplus(a + dt_bias)`, `beta = sigmoid(b)`,
  i.e. `deltarule.gate`.

Behaviour follows onnxruntime 1.32's CPU execution provider (where it and the
WebGPU kernel card differ, see docs/contracts.md). Inputs are NumPy arrays or
torch tensors; outputs come back in the kind of the first input. A call the
operator rejects raises `deltarule.ContractError` naming the ORT input or
attribute; features deltarule cannot run (compact state-update capture,
`state_window`) raise it too, saying so.
"""

from __future__ import annotations

import math

import torch

from ..api import finite_float32
from ..api import call as _call
from ..errors import ContractError
from ..gate import gate as _gate
from ._convert import Kind, dtype_name
from .onnx import DELTA, FLOAT_DTYPES, GATED, RULES, _packed, check_int_attr, check_scale

__all__ = ["gated_delta_net", "linear_attention", "linear_attention_gate", "L2NORM_EPS"]

# GatedDeltaNet's qk_l2_norm: x * rsqrt(sum(x^2) + 1e-12), deltarule's formula with this eps.
L2NORM_EPS = 1e-12

_GATE_ACTIVATIONS = ("none", "softplus", "qwen", "sigmoid", "kda")
_INT32_MAX = 2**31 - 1


def gated_delta_net(
    query,
    key,
    value,
    cu_seqlens=None,
    decay=None,
    beta=None,
    initial_state=None,
    a_log=None,
    dt_bias=None,
    *,
    update_rule: str = "gated_delta",
    scale: float = 0.0,
    gate_activation: str = "none",
    beta_activation: str = "none",
    qk_l2_norm: int = 0,
    chunk_size: int = 64,
    state_update_capacity: int = 0,
    gate_lower_bound: float = -5.0,
):
    """`com.microsoft.GatedDeltaNet`: returns (output, final_state).

    Args:
        query: (T, H_q, d_k) token-major, or (B, S, H_q, d_k); float32 /
            float16 / bfloat16. With `key` and `value` both None, `query` is
            packed QKV, (T, W) or (B, S, W) with
            W = 2 * H_q * d_k + H_v * d_v, split by `initial_state`'s shape.
        key: query's shape and dtype (H_k == H_q).
        value: (..., H_v, d_v) over query's leading axes, H_v a positive
            multiple of H_q (value head h reads query / key head
            h // (H_v / H_q)); query's dtype.
        cu_seqlens: optional int32 (N + 1) exclusive prefix sums for the rank-3
            form, clamped to [0, T] as the operator's card specifies: a
            decreasing or equal pair is an empty request, whose state is copied
            through; tokens outside every request get a zero output (ORT's CPU
            kernel raises on such offsets instead). Absent: rank 3 takes
            the batch size from `initial_state` (T divisible by it), rank 4
            from its shape.
        decay: (..., H_v) per head or (..., H_v, d_k) per key over query's
            leading axes; log space, or the raw projection with
            `gate_activation`; float32 or query's dtype (shared with `beta`).
            Exactly for "gated" / "gated_delta".
        beta: (..., H_v); exactly for "delta" / "gated_delta".
        initial_state: optional float32 (N, H_v, d_v, d_k), V-major; zeros
            when absent.
        a_log: float32 (H_v); exactly when gate_activation is not "none".
        dt_bias: float32 (H_v), or with per-key decay (H_v, d_k) / (H_v * d_k);
            exactly when gate_activation is not "none".
        update_rule: "linear" | "gated" | "delta" | "gated_delta" (default).
        scale: 0.0 (default) selects 1 / sqrt(d_k).
        gate_activation: "none" (decay is the log-space decay), "softplus"
            (alias "qwen": -exp(a_log) * softplus(decay + dt_bias)) or
            "sigmoid" (alias "kda": gate_lower_bound *
            sigmoid(exp(a_log) * (decay + dt_bias))), in float32.
        beta_activation: "none" or "sigmoid" (float32); unused without beta.
        qk_l2_norm: nonzero L2-normalises each query and key head vector,
            x * rsqrt(sum(x^2) + 1e-12), in float32.
        chunk_size: scheduling hint in [1, 2^31 - 1]; never changes the result.
        state_update_capacity: must be 0 (compact state-update capture, and
            with it `capture_count` / `state_update_active` / `state_update`,
            is not supported).
        gate_lower_bound: finite and negative; used by the "sigmoid" gate.

    Returns:
        (output, final_state): output (..., H_v, d_v) with query's leading
        axes, in query's dtype; final_state float32 (N, H_v, d_v, d_k).

    Raises:
        ContractError: any input or attribute the operator rejects, or an
            unsupported feature.
    """
    kind, args, out_shape = gated_delta_net_arguments(
        query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias, update_rule=update_rule,
        scale=scale, gate_activation=gate_activation, beta_activation=beta_activation, qk_l2_norm=qk_l2_norm,
        chunk_size=chunk_size, state_update_capacity=state_update_capacity, gate_lower_bound=gate_lower_bound)
    o, state = _call(**args)
    return kind.out(o.reshape(out_shape)), kind.out(state)


def gated_delta_net_arguments(query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias, *,
                              update_rule, scale, gate_activation, beta_activation, qk_l2_norm, chunk_size,
                              state_update_capacity, gate_lower_bound) -> tuple[Kind, dict, tuple]:
    """`gated_delta_net`'s validation and mapping: (the caller's kind, the keyword arguments of
    deltarule's call, the output's shape). The kernel card exporter runs the same mapping
    through the float64 reference (deltarule/cards)."""
    kind = Kind("query", query)
    x = kind.tensor("query", query, optional=False)

    # --- attributes ---------------------------------------------------------
    if not isinstance(update_rule, str) or update_rule not in RULES:
        raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(update_rule))
    if not isinstance(gate_activation, str) or gate_activation not in _GATE_ACTIVATIONS:
        raise ContractError("gate_activation", "'none', 'softplus' (alias 'qwen') or 'sigmoid' (alias 'kda')",
                            repr(gate_activation))
    if beta_activation not in ("none", "sigmoid"):
        raise ContractError("beta_activation", "'none' or 'sigmoid'", repr(beta_activation))
    l2norm = check_int_attr("qk_l2_norm", qk_l2_norm, allow_bool=True) != 0
    check_int_attr("chunk_size", chunk_size, minimum=1, maximum=_INT32_MAX)
    capacity = check_int_attr("state_update_capacity", state_update_capacity)
    if capacity != 0:
        raise ContractError(
            "state_update_capacity", "0 (compact state-update capture is not supported)", capacity)
    if not finite_float32(gate_lower_bound) or gate_lower_bound >= 0:
        raise ContractError("gate_lower_bound", "a negative float finite in float32", repr(gate_lower_bound))
    scale = check_scale(scale)

    # --- query / key / value (or packed QKV) --------------------------------
    s0 = kind.tensor("initial_state", initial_state)
    if s0 is not None:
        if s0.dim() != 4:
            raise ContractError("initial_state", "a rank-4 tensor (batch, H_v, d_v, d_k)",
                                f"shape {list(s0.shape)}")
        if s0.dtype != torch.float32:
            raise ContractError("initial_state", "dtype float32", dtype_name(s0.dtype))
        if s0.device != x.device:
            raise ContractError("initial_state", f"device {x.device} (query's)", s0.device)
    if key is None and value is None:
        q, k, v = _split_packed(x, s0)
    elif key is None or value is None:
        missing = "key" if key is None else "value"
        raise ContractError(missing, "present with key / value, or both absent (packed QKV)", "absent")
    else:
        q = x
        k = kind.tensor("key", key, optional=False)
        v = kind.tensor("value", value, optional=False)
    if q.dim() not in (3, 4):
        raise ContractError("query", "a rank-3 (T, H_q, d_k) or rank-4 (B, S, H_q, d_k) tensor",
                            f"shape {list(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ContractError("query", "dtype float32, float16 or bfloat16 (type T)", dtype_name(q.dtype))
    lead = tuple(q.shape[:-2])
    Hq, Dk = q.shape[-2], q.shape[-1]
    if Hq < 1 or Dk < 1:
        raise ContractError("query", "H_q >= 1 and d_k >= 1", f"shape {list(q.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ContractError("key", f"query's shape {list(q.shape)} (H_k == H_q, same d_k)",
                            f"shape {list(k.shape)}")
    if v.dim() != q.dim() or tuple(v.shape[:-2]) != lead or v.shape[-1] < 1:
        raise ContractError("value", f"({', '.join(map(str, lead))}, H_v, d_v) over query's leading axes",
                            f"shape {list(v.shape)}")
    Hv, Dv = v.shape[-2], v.shape[-1]
    if Hv < 1 or Hv % Hq:
        raise ContractError("value", f"H_v a positive multiple of H_q = {Hq}", f"H_v = {Hv}")
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            raise ContractError(name, f"query's dtype {dtype_name(q.dtype)} (type T)", dtype_name(t.dtype))
        if t.device != q.device:
            raise ContractError(name, f"device {q.device} (query's)", t.device)
    total = math.prod(lead)
    if total < 1:
        raise ContractError("query", "at least one token", f"shape {list(q.shape)}")

    # --- requests: cu_seqlens, uniform packing, or the rank-4 batch ---------
    cu = kind.tensor("cu_seqlens", cu_seqlens)
    if cu is not None:
        if len(lead) != 1:
            raise ContractError("cu_seqlens", "absent with the rank-4 (B, S, H, D) form (ragged packing "
                                "needs the rank-3 form)", "a tensor")
        if cu.dtype != torch.int32:
            raise ContractError("cu_seqlens", "dtype int32", dtype_name(cu.dtype))
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ContractError("cu_seqlens", "rank 1 with at least 2 entries", f"shape {list(cu.shape)}")
        N = cu.shape[0] - 1                  # offsets are clamped by linear_attention
        B, S = 1, total
        cu = cu.to(q.device)
    elif len(lead) == 1:
        if s0 is None:
            raise ContractError("initial_state", "present when cu_seqlens is absent from the rank-3 form "
                                "(it gives the batch size)", "absent")
        N = s0.shape[0]
        if N < 1 or total % N:
            raise ContractError("initial_state", f"a batch size dividing total_tokens = {total}",
                                f"batch {N}")
        B, S = N, total // N
    else:
        B, S = lead
        N = B
    if s0 is not None and tuple(s0.shape) != (N, Hv, Dv, Dk):
        raise ContractError("initial_state", f"(batch, H_v, d_v, d_k) = ({N}, {Hv}, {Dv}, {Dk}), V-major",
                            f"shape {list(s0.shape)}")

    # --- gates --------------------------------------------------------------
    gating, delta = update_rule in GATED, update_rule in DELTA
    d = kind.tensor("decay", decay)
    b = kind.tensor("beta", beta)
    for name, t, needed in (("decay", d, gating), ("beta", b, delta)):
        if needed and t is None:
            raise ContractError(name, f"an input for update_rule {update_rule!r}", "absent")
        if not needed and t is not None:
            raise ContractError(name, f"absent for update_rule {update_rule!r}", "a tensor")
    gate_dtypes = (torch.float32, q.dtype)
    for name, t in (("decay", d), ("beta", b)):
        if t is None:
            continue
        if t.dtype not in gate_dtypes:
            raise ContractError(name, f"dtype float32 or query's {dtype_name(q.dtype)}", dtype_name(t.dtype))
        if t.device != q.device:
            raise ContractError(name, f"device {q.device} (query's)", t.device)
    if d is not None and b is not None and d.dtype != b.dtype:
        raise ContractError("beta", f"decay's dtype {dtype_name(d.dtype)} (type TG)", dtype_name(b.dtype))
    per_key = False
    if d is not None:
        if tuple(d.shape) not in (lead + (Hv,), lead + (Hv, Dk)):
            raise ContractError("decay", f"{list(lead + (Hv,))} or {list(lead + (Hv, Dk))}",
                                f"shape {list(d.shape)}")
        per_key = d.dim() == len(lead) + 2
    if b is not None and tuple(b.shape) != lead + (Hv,):
        raise ContractError("beta", f"{list(lead + (Hv,))}", f"shape {list(b.shape)}")

    A, bias = kind.tensor("a_log", a_log), kind.tensor("dt_bias", dt_bias)
    if gate_activation == "none":
        for name, t in (("a_log", A), ("dt_bias", bias)):
            if t is not None:
                raise ContractError(name, "absent with gate_activation 'none'", "a tensor")
    else:
        for name, t in (("a_log", A), ("dt_bias", bias)):
            if t is None:
                raise ContractError(name, f"an input with gate_activation {gate_activation!r}", "absent")
            if t.dtype != torch.float32:
                raise ContractError(name, "dtype float32", dtype_name(t.dtype))
            if t.device != q.device:
                raise ContractError(name, f"device {q.device} (query's)", t.device)
        if tuple(A.shape) != (Hv,):
            raise ContractError("a_log", f"shape [{Hv}] (H_v)", f"shape {list(A.shape)}")
        bias_shapes = [(Hv,)] + ([(Hv, Dk), (Hv * Dk,)] if per_key else [])
        if tuple(bias.shape) not in bias_shapes:
            raise ContractError("dt_bias", " or ".join(str(list(s)) for s in bias_shapes),
                                f"shape {list(bias.shape)}")

    # --- onto deltarule -----------------------------------------------------
    def rows(t):                                   # leading axes -> (B, S)
        return t.reshape((B, S) + tuple(t.shape[len(lead):]))

    g = gk = A_log = bias_arg = None
    if d is not None:
        raw = rows(d)
        if gate_activation != "none":
            bias_arg = bias.reshape(Hv, -1).expand(Hv, Dk).contiguous() if per_key else bias
        if gate_activation in ("softplus", "qwen"):
            A_log = A
        elif gate_activation in ("sigmoid", "kda"):
            # the bounded KDA gate, formed here in float32 (deltarule's raw-gate arm is softplus)
            rate = torch.exp(A)[:, None] if per_key else torch.exp(A)
            raw = float(gate_lower_bound) * torch.sigmoid(rate * (raw.to(torch.float32) + bias_arg))
            bias_arg = None
        if per_key:
            gk = raw
        else:
            g = raw
    beta_arg = rows(b) if b is not None else None

    args = dict(
        q=rows(q), k=rows(k), v=rows(v), rule=update_rule, g=g, gk=gk, beta=beta_arg, scale=scale,
        initial_state=s0, state_layout="vk", cu_seqlens=cu, qk_l2norm=l2norm,
        l2norm_eps=L2NORM_EPS, A_log=A_log, dt_bias=bias_arg if A_log is not None else None,
        beta_sigmoid=beta_activation == "sigmoid" and delta, chunk_size=chunk_size,
        accept_growth=True,  # the runtime takes any log decay; linear_attention refuses > 0
    )
    return kind, args, lead + (Hv, Dv)


def _split_packed(x: torch.Tensor, s0: torch.Tensor | None):
    """Packed QKV (..., 2 * H_q * d_k + H_v * d_v) -> q, k, v (..., H, D); shapes from initial_state."""
    if s0 is None:
        raise ContractError("initial_state", "present for packed QKV (it gives the head counts and sizes)",
                            "absent")
    if x.dim() not in (2, 3):
        raise ContractError("query", "packed QKV of rank 2 (T, W) or rank 3 (B, S, W)",
                            f"shape {list(x.shape)}")
    _, Hv, Dv, Dk = s0.shape
    W = x.shape[-1]
    rest = W - Hv * Dv
    if Hv < 1 or Dv < 1 or Dk < 1 or rest <= 0 or rest % (2 * Dk):
        raise ContractError("query", f"packed QKV width 2 * H_q * {Dk} + {Hv} * {Dv} with H_q >= 1",
                            f"width {W}")
    Hq = rest // (2 * Dk)
    lead = tuple(x.shape[:-1])
    q = x[..., : Hq * Dk].reshape(lead + (Hq, Dk))
    k = x[..., Hq * Dk: 2 * Hq * Dk].reshape(lead + (Hq, Dk))
    v = x[..., 2 * Hq * Dk:].reshape(lead + (Hv, Dv))
    return q, k, v


def linear_attention(
    query,
    key,
    value,
    past_state=None,
    decay=None,
    beta=None,
    *,
    q_num_heads: int,
    kv_num_heads: int,
    update_rule: str = "gated_delta",
    scale: float = 0.0,
    chunk_size: int = 64,
    state_window: int = 0,
):
    """`com.microsoft.LinearAttention`: returns (output, present_state).

    ONNX `LinearAttention` (see `deltarule.contracts.onnx.linear_attention`)
    with ONNX Runtime's extensions and leniencies:

    - inverse GQA: kv_num_heads may be a positive multiple of q_num_heads;
      value head h then reads query head h // (kv_num_heads / q_num_heads)
      and the output has max(q_num_heads, kv_num_heads) heads;
    - key's head count H_k = key.shape[-1] / d_k is read from its shape and
      may be any divisor of kv_num_heads (kv head h reads key head
      h // (kv_num_heads / H_k));
    - a decay or beta that the update rule does not use is ignored (ONNX
      forbids it).

    `state_window` (speculative-decoding state windows) is not supported:
    any value but 0 raises ContractError.

    Returns:
        (output (B, T, max(H_q, H_kv) * d_v) in query's dtype,
         present_state (B, H_kv, d_k, d_v) in past_state's dtype, or query's
         when past_state is absent).
    """
    window = check_int_attr("state_window", state_window)
    if window != 0:
        raise ContractError("state_window", "0 (windowed states are not supported)", window)
    return _packed(
        query, key, value, past_state, decay, beta,
        q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, update_rule=update_rule,
        scale=scale, chunk_size=chunk_size, contrib=True,
    )


def linear_attention_gate(a, dt_bias, decay_scale, b=None):
    """`com.microsoft.LinearAttentionGate`: (decay, beta) = `deltarule.gate(...)`.

    decay = decay_scale * softplus(a + dt_bias), beta = sigmoid(b) (None when
    `b` is None), in float32, stored in `a`'s dtype. `a`: rank >= 1, last axis
    the heads H >= 1; `dt_bias`, `decay_scale`: float32 (H); `b`: `a`'s shape
    and dtype. NumPy in, NumPy out.
    """
    kind = Kind("a", a)
    return tuple(kind.out(t) for t in _gate(
        kind.tensor("a", a, optional=False), kind.tensor("dt_bias", dt_bias, optional=False),
        kind.tensor("decay_scale", decay_scale, optional=False), kind.tensor("b", b),
    ))

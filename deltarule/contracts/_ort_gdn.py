"""`com.microsoft.GatedDeltaNet` (onnxruntime 1.32) on top of deltarule: the argument checks,
one function per argument group, the mapping onto `deltarule.api.call`, and the compact
state-update capture. The public names live in `deltarule.contracts.ort`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..api import call as _call
from ..api import finite_float32
from ..errors import ContractError
from ._convert import Kind, dtype_name
from .onnx_linear_attention import DELTA, FLOAT_DTYPES, RULES, check_gate_presence, check_int_attr, check_scale

# GatedDeltaNet's qk_l2_norm: x * rsqrt(sum(x^2) + eps), deltarule's formula, with eps 1e-12 ...
L2NORM_EPS = 1e-12
# ... except beside the bounded KDA gate (gate_activation "sigmoid" / "kda"), where onnxruntime
# 1.32's CPU kernel normalises with fla's KDA epsilon (found from its output; the schema names none)
KDA_L2NORM_EPS = 1e-6
# state_update_capacity's range in the schema ("in [0, 8]"; ORT's shape inference refuses others)
MAX_CAPACITY = 8

GATE_ACTIVATIONS = ("none", "softplus", "qwen", "sigmoid", "kda")
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
    capture_count=None,
    state_update_active=None,
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
    """`com.microsoft.GatedDeltaNet`: returns (output, final_state), and with
    state_update_capacity C > 0 (output, final_state, state_update).

    Letters: T tokens (rank-3 form) or B x S (rank-4 form), N requests, H_q query / key
    heads, H_v value heads, d_k / d_v head sizes, C the capacity, Dw the decay width
    (H_v for per-head decay, H_v * d_k for per-key decay).

    Args:
        query: [T, H_q, d_k] token-major, or [B, S, H_q, d_k]; float32 / float16 /
            bfloat16. With `key` and `value` both None, `query` is packed QKV, [T, W] or
            [B, S, W] with W = 2 * H_q * d_k + H_v * d_v, split by `initial_state`'s shape.
        key: query's shape and dtype (H_k == H_q). Default None (packed QKV).
        value: [..., H_v, d_v] over query's leading axes, H_v a positive multiple of H_q
            (value head h reads query / key head h // (H_v / H_q)); query's dtype.
            Default None (packed QKV).
        cu_seqlens: optional int32 [N + 1] exclusive prefix sums for the rank-3 form,
            clamped to [0, T] as the operator's card specifies: a decreasing or equal pair
            is an empty request, whose state is copied through; tokens outside every
            request get a zero output (ORT's CPU kernel raises on such offsets instead).
            Absent (default): rank 3 takes N from `initial_state` (T divisible by it),
            rank 4 N = B.
        decay: [..., H_v] per head or [..., H_v, d_k] per key over query's leading axes;
            log space, or the raw projection with `gate_activation`; float32 or query's
            dtype (shared with `beta`). Exactly for "gated" / "gated_delta".
        beta: [..., H_v]; exactly for "delta" / "gated_delta".
        initial_state: optional float32 [N, H_v, d_v, d_k], V-major; zeros when absent.
            Only read: it may be the very buffer the caller then overwrites with
            `final_state` (ORT lets the two alias); the result is a new tensor.
        a_log: float32 [H_v]; exactly when gate_activation is not "none".
        dt_bias: float32 [H_v], or with per-key decay [H_v, d_k] / [H_v * d_k]; exactly
            when gate_activation is not "none".
        capture_count: int32 [N]: how many leading transitions of each request to
            capture, clamped to [0, min(C, the request's length)] as ORT clamps it.
            Required exactly when C > 0 (ContractError naming it otherwise).
        state_update_active: optional int32 [1], read on the host: 0 disables the
            capture (capture_count is then ignored and state_update is all zeros, the
            call may run chunked); any other value, or absent (default), captures.
        update_rule: "linear" | "gated" | "delta" | "gated_delta" (default).
        scale: 0.0 (default) selects 1 / sqrt(d_k).
        gate_activation: "none" (default; decay is the log-space decay), "softplus"
            (alias "qwen": -exp(a_log) * softplus(decay + dt_bias)) or "sigmoid" (alias
            "kda": gate_lower_bound * sigmoid(exp(a_log) * (decay + dt_bias))), in float32.
        beta_activation: "none" (default) or "sigmoid" (float32); unused without beta.
        qk_l2_norm: nonzero L2-normalises each query and key head vector,
            x * rsqrt(sum(x^2) + eps), in float32, eps 1e-12 (1e-6 with the "sigmoid" /
            "kda" gate, as ORT 1.32's CPU kernel computes it). Default 0.
        chunk_size: scheduling hint in [1, 2^31 - 1], default 64; never changes the result.
        state_update_capacity: C in [0, 8], default 0 (no capture).
        gate_lower_bound: finite and negative, default -5.0; used by the "sigmoid" gate.

    Returns:
        output: [..., H_v, d_v] with query's leading axes, query's dtype.
        final_state: float32 [N, H_v, d_v, d_k] (a new tensor).
        state_update (only when C > 0): float32 [N, C * (Dw + H_q * d_k + H_v * d_v)],
            struct-of-arrays per request n: C decay factors exp(g) [Dw] (1.0 for the
            rules without decay), then C keys as the recurrence uses them (after
            qk_l2_norm) [H_q, d_k], then C deltas u [H_v, d_v] (beta * (v - exp(g)
            S^T k) for the delta rules, v for "linear" / "gated"), so that
            S_t = diag(decay) S_{t-1} + k u^T (K-major S). Entries of transitions at or
            past the clamped count are unspecified in ORT; here they are zeros, so the
            output is deterministic (ORT 1.32's CPU kernel happens to zero them too).

    Raises:
        ContractError: any input or attribute the operator rejects, before any work.
    """
    m = gated_delta_net_mapping(
        query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias, capture_count,
        state_update_active, update_rule=update_rule, scale=scale, gate_activation=gate_activation,
        beta_activation=beta_activation, qk_l2_norm=qk_l2_norm, chunk_size=chunk_size,
        state_update_capacity=state_update_capacity, gate_lower_bound=gate_lower_bound)
    o, state = _call(**m.args)
    out = (m.kind.out(o.reshape(m.out_shape)), m.kind.out(state))
    if m.capture is None:
        return out
    return out + (m.kind.out(m.capture.finish()),)


def gated_delta_net_arguments(query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias,
                              capture_count=None, state_update_active=None, *, update_rule, scale,
                              gate_activation, beta_activation, qk_l2_norm, chunk_size, state_update_capacity,
                              gate_lower_bound) -> tuple[Kind, dict, tuple]:
    """`gated_delta_net`'s validation and mapping: (the caller's kind, the keyword arguments of
    deltarule's call, the output's shape). With an active capture the arguments carry the
    zero-filled `capture` buffer (entries past the counts are zeroed by `gated_delta_net`
    after the call). The kernel card exporter runs the same mapping through the float64
    reference (deltarule/cards)."""
    m = gated_delta_net_mapping(
        query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias, capture_count,
        state_update_active, update_rule=update_rule, scale=scale, gate_activation=gate_activation,
        beta_activation=beta_activation, qk_l2_norm=qk_l2_norm, chunk_size=chunk_size,
        state_update_capacity=state_update_capacity, gate_lower_bound=gate_lower_bound)
    return m.kind, m.args, m.out_shape


@dataclass
class Mapping:
    """One checked call: the caller's kind, deltarule's keyword arguments, the output's shape
    and the capture (None when C = 0)."""

    kind: Kind
    args: dict
    out_shape: tuple
    capture: Capture | None


def gated_delta_net_mapping(query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias,
                            capture_count, state_update_active, *, update_rule, scale, gate_activation,
                            beta_activation, qk_l2_norm, chunk_size, state_update_capacity,
                            gate_lower_bound) -> Mapping:
    """Every check of `gated_delta_net`, in groups, then the mapping onto deltarule."""
    kind = Kind("query", query)
    x = kind.tensor("query", query, optional=False)
    attrs = _attributes(update_rule, gate_activation, beta_activation, qk_l2_norm, chunk_size,
                        state_update_capacity, gate_lower_bound, scale)
    s0 = _initial_state(kind, initial_state, x.device)
    q, k, v = _query_key_value(kind, x, key, value, s0)
    lead = tuple(q.shape[:-2])
    Hq, Dk, Hv, Dv = q.shape[-2], q.shape[-1], v.shape[-2], v.shape[-1]
    cu, N, B, S = _requests(kind, cu_seqlens, lead, s0, q.device)
    _check_state_shape(s0, N, Hv, Dv, Dk)
    d, b, A, bias = _gates(kind, decay, beta, a_log, dt_bias, attrs, q, lead, Hv, Dk)
    per_key = d is not None and d.dim() == len(lead) + 2
    capture = _capture(kind, capture_count, state_update_active, attrs.capacity, N,
                       widths=(Hv * Dk if per_key else Hv, Hq * Dk, Hv * Dv), device=q.device)

    def rows(t):                                   # leading axes -> (B, S)
        return t.reshape((B, S) + tuple(t.shape[len(lead):]))

    g, gk, A_log, dt_bias_arg = _deltarule_gates(rows(d) if d is not None else None, A, bias, attrs, per_key,
                                                 Hv, Dk)
    args = dict(
        q=rows(q), k=rows(k), v=rows(v), rule=attrs.rule, g=g, gk=gk,
        beta=rows(b) if b is not None else None, scale=attrs.scale, initial_state=s0, state_layout="vk",
        cu_seqlens=cu, qk_l2norm=attrs.l2norm, l2norm_eps=KDA_L2NORM_EPS if attrs.gate in ("sigmoid", "kda")
        else L2NORM_EPS, A_log=A_log, dt_bias=dt_bias_arg,
        beta_sigmoid=attrs.beta_sigmoid and attrs.rule in DELTA, chunk_size=attrs.chunk_size,
        accept_growth=True,  # the runtime takes any log decay; linear_attention refuses > 0
    )
    if capture is not None and capture.active:
        args["capture"] = capture.buffer
    return Mapping(kind, args, lead + (Hv, Dv), capture)


# --- attributes --------------------------------------------------------------

@dataclass(frozen=True)
class Attributes:
    rule: str
    gate: str
    beta_sigmoid: bool
    l2norm: bool
    chunk_size: int
    capacity: int
    lower_bound: float
    scale: float | None


def _attributes(update_rule, gate_activation, beta_activation, qk_l2_norm, chunk_size, state_update_capacity,
                gate_lower_bound, scale) -> Attributes:
    if not isinstance(update_rule, str) or update_rule not in RULES:
        raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(update_rule))
    if not isinstance(gate_activation, str) or gate_activation not in GATE_ACTIVATIONS:
        raise ContractError("gate_activation", "'none', 'softplus' (alias 'qwen') or 'sigmoid' (alias 'kda')",
                            repr(gate_activation))
    if beta_activation not in ("none", "sigmoid"):
        raise ContractError("beta_activation", "'none' or 'sigmoid'", repr(beta_activation))
    l2norm = check_int_attr("qk_l2_norm", qk_l2_norm, allow_bool=True) != 0
    chunk = check_int_attr("chunk_size", chunk_size, minimum=1, maximum=_INT32_MAX)
    capacity = check_int_attr("state_update_capacity", state_update_capacity, minimum=0, maximum=MAX_CAPACITY)
    if not finite_float32(gate_lower_bound) or gate_lower_bound >= 0:
        raise ContractError("gate_lower_bound", "a negative float finite in float32", repr(gate_lower_bound))
    return Attributes(update_rule, gate_activation, beta_activation == "sigmoid", l2norm, chunk, capacity,
                      float(gate_lower_bound), check_scale(scale))


# --- query / key / value (or packed QKV) and the state -------------------------

def _initial_state(kind: Kind, initial_state, device) -> torch.Tensor | None:
    s0 = kind.tensor("initial_state", initial_state)
    if s0 is None:
        return None
    if s0.dim() != 4:
        raise ContractError("initial_state", "a rank-4 tensor (batch, H_v, d_v, d_k)", f"shape {list(s0.shape)}")
    if s0.dtype != torch.float32:
        raise ContractError("initial_state", "dtype float32", dtype_name(s0.dtype))
    if s0.device != device:
        raise ContractError("initial_state", f"device {device} (query's)", s0.device)
    return s0


def _check_state_shape(s0: torch.Tensor | None, N: int, Hv: int, Dv: int, Dk: int) -> None:
    """initial_state's shape, once the requests give its batch N: (N, H_v, d_v, d_k), V-major."""
    if s0 is not None and tuple(s0.shape) != (N, Hv, Dv, Dk):
        raise ContractError("initial_state", f"(batch, H_v, d_v, d_k) = ({N}, {Hv}, {Dv}, {Dk}), V-major",
                            f"shape {list(s0.shape)}")


def _query_key_value(kind: Kind, x: torch.Tensor, key, value, s0):
    """q, k, v as (..., H, D) over the leading token axes, checked against each other."""
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
    Hv = v.shape[-2]
    if Hv < 1 or Hv % Hq:
        raise ContractError("value", f"H_v a positive multiple of H_q = {Hq}", f"H_v = {Hv}")
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            raise ContractError(name, f"query's dtype {dtype_name(q.dtype)} (type T)", dtype_name(t.dtype))
        if t.device != q.device:
            raise ContractError(name, f"device {q.device} (query's)", t.device)
    if math.prod(lead) < 1:
        raise ContractError("query", "at least one token", f"shape {list(q.shape)}")
    return q, k, v


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


# --- requests: cu_seqlens, uniform packing, or the rank-4 batch -----------------

def _requests(kind: Kind, cu_seqlens, lead: tuple, s0, device):
    """(cu_seqlens on q's device or None, N requests, and the (B, S) rows deltarule sees)."""
    total = math.prod(lead)
    cu = kind.tensor("cu_seqlens", cu_seqlens)
    if cu is not None:
        if len(lead) != 1:
            raise ContractError("cu_seqlens", "absent with the rank-4 (B, S, H, D) form (ragged packing "
                                "needs the rank-3 form)", "a tensor")
        if cu.dtype != torch.int32:
            raise ContractError("cu_seqlens", "dtype int32", dtype_name(cu.dtype))
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ContractError("cu_seqlens", "rank 1 with at least 2 entries", f"shape {list(cu.shape)}")
        return cu.to(device), cu.shape[0] - 1, 1, total      # offsets are clamped by linear_attention
    if len(lead) == 2:
        return None, lead[0], lead[0], lead[1]
    if s0 is None:
        raise ContractError("initial_state", "present when cu_seqlens is absent from the rank-3 form "
                            "(it gives the batch size)", "absent")
    N = s0.shape[0]
    if N < 1 or total % N:
        raise ContractError("initial_state", f"a batch size dividing total_tokens = {total}", f"batch {N}")
    return None, N, N, total // N


# --- gates -------------------------------------------------------------------

def _gates(kind: Kind, decay, beta, a_log, dt_bias, attrs: Attributes, q: torch.Tensor, lead: tuple, Hv: int,
           Dk: int):
    """The checked decay, beta, a_log and dt_bias (None where absent)."""
    d = kind.tensor("decay", decay)
    b = kind.tensor("beta", beta)
    check_gate_presence(d, b, attrs.rule)
    for name, t in (("decay", d), ("beta", b)):
        if t is None:
            continue
        if t.dtype not in (torch.float32, q.dtype):
            raise ContractError(name, f"dtype float32 or query's {dtype_name(q.dtype)}", dtype_name(t.dtype))
        if t.device != q.device:
            raise ContractError(name, f"device {q.device} (query's)", t.device)
    if d is not None and b is not None and d.dtype != b.dtype:
        raise ContractError("beta", f"decay's dtype {dtype_name(d.dtype)} (type TG)", dtype_name(b.dtype))
    if d is not None and tuple(d.shape) not in (lead + (Hv,), lead + (Hv, Dk)):
        raise ContractError("decay", f"{list(lead + (Hv,))} or {list(lead + (Hv, Dk))}", f"shape {list(d.shape)}")
    if b is not None and tuple(b.shape) != lead + (Hv,):
        raise ContractError("beta", f"{list(lead + (Hv,))}", f"shape {list(b.shape)}")
    per_key = d is not None and d.dim() == len(lead) + 2
    A, bias = _gate_parameters(kind, a_log, dt_bias, attrs.gate, q.device, Hv, Dk, per_key)
    return d, b, A, bias


def _gate_parameters(kind: Kind, a_log, dt_bias, gate: str, device, Hv: int, Dk: int, per_key: bool):
    """a_log and dt_bias: present exactly with a gate activation (even for rules without decay)."""
    A, bias = kind.tensor("a_log", a_log), kind.tensor("dt_bias", dt_bias)
    if gate == "none":
        for name, t in (("a_log", A), ("dt_bias", bias)):
            if t is not None:
                raise ContractError(name, "absent with gate_activation 'none'", "a tensor")
        return None, None
    for name, t in (("a_log", A), ("dt_bias", bias)):
        if t is None:
            raise ContractError(name, f"an input with gate_activation {gate!r}", "absent")
        if t.dtype != torch.float32:
            raise ContractError(name, "dtype float32", dtype_name(t.dtype))
        if t.device != device:
            raise ContractError(name, f"device {device} (query's)", t.device)
    if tuple(A.shape) != (Hv,):
        raise ContractError("a_log", f"shape [{Hv}] (H_v)", f"shape {list(A.shape)}")
    bias_shapes = [(Hv,)] + ([(Hv, Dk), (Hv * Dk,)] if per_key else [])
    if tuple(bias.shape) not in bias_shapes:
        raise ContractError("dt_bias", " or ".join(str(list(s)) for s in bias_shapes), f"shape {list(bias.shape)}")
    return A, bias


def _deltarule_gates(raw, A, bias, attrs: Attributes, per_key: bool, Hv: int, Dk: int):
    """The decay as deltarule takes it: (g, gk, A_log, dt_bias). "softplus" / "qwen" is
    deltarule's raw-gate arm; the bounded "sigmoid" / "kda" gate is formed here in float32."""
    if raw is None:
        return None, None, None, None
    A_log = dt_bias = None
    if attrs.gate != "none":
        dt_bias = bias.reshape(Hv, -1).expand(Hv, Dk).contiguous() if per_key else bias
    if attrs.gate in ("softplus", "qwen"):
        A_log = A
    elif attrs.gate in ("sigmoid", "kda"):
        rate = torch.exp(A)[:, None] if per_key else torch.exp(A)
        raw = attrs.lower_bound * torch.sigmoid(rate * (raw.to(torch.float32) + dt_bias))
        dt_bias = None
    return (None, raw, A_log, dt_bias) if per_key else (raw, None, A_log, dt_bias)


# --- compact state-update capture ----------------------------------------------

@dataclass
class Capture:
    """The state_update output: `buffer` [N, C * (Dw + step)] float32, zero-filled, handed to
    deltarule's `capture=` when `active`; `counts` the clamp of capture_count to [0, C] on the
    host (the clamp to the request's length is the core's: it writes min(C, length))."""

    capacity: int
    widths: tuple[int, int, int]      # one transition's decay, key and delta: (Dw, H_q * d_k, H_v * d_v)
    counts: list[int]
    active: bool
    buffer: torch.Tensor

    def finish(self) -> torch.Tensor:
        """The buffer with every entry at or past its request's count zeroed (ORT leaves those
        unspecified; deltarule writes min(C, length) of them)."""
        C, at, parts = self.capacity, 0, []
        for width in self.widths:                 # struct of arrays: C decays, C keys, C deltas
            parts.append(self.buffer[:, at: at + C * width].view(-1, C, width))
            at += C * width
        for n, count in enumerate(self.counts):
            for part in parts:
                part[n, count:] = 0
        return self.buffer


def _capture(kind: Kind, capture_count, state_update_active, capacity: int, N: int, *, widths: tuple,
             device) -> Capture | None:
    """capture_count (int32 [N], present exactly when C > 0) and state_update_active (int32
    [1], optional, read on the host) as a `Capture`; None when C = 0."""
    count = kind.tensor("capture_count", capture_count)
    active = kind.tensor("state_update_active", state_update_active)
    if count is None and capacity > 0:
        raise ContractError("capture_count", f"an int32 [batch_size] = [{N}] input when state_update_capacity "
                            f"= {capacity} > 0", "absent")
    if count is not None and capacity == 0:
        raise ContractError("capture_count", "absent when state_update_capacity is 0", "a tensor")
    if count is not None:
        if count.dtype != torch.int32:
            raise ContractError("capture_count", "dtype int32", dtype_name(count.dtype))
        if tuple(count.shape) != (N,):
            raise ContractError("capture_count", f"shape [batch_size] = [{N}]", f"shape {list(count.shape)}")
    on = True
    if active is not None:
        if active.dtype != torch.int32:
            raise ContractError("state_update_active", "dtype int32", dtype_name(active.dtype))
        if tuple(active.shape) != (1,):
            raise ContractError("state_update_active", "shape [1]", f"shape {list(active.shape)}")
        on = int(active.reshape(()).item()) != 0       # a CPU control: read here
    if capacity == 0:
        return None
    counts = count.clamp(0, capacity).tolist() if on else [0] * N
    buffer = torch.zeros(N, capacity * sum(widths), dtype=torch.float32, device=device)
    return Capture(capacity, widths, counts, on, buffer)

"""ONNX `LinearAttention` (opset 27, default domain) on top of `deltarule.linear_attention`.

    from deltarule.contracts.onnx_linear_attention import linear_attention
    output, present_state = linear_attention(query, key, value, past_state, decay, beta,
                                             q_num_heads=8, kv_num_heads=2)

The operator's inputs, attributes and defaults, with the behaviour of the
ONNX reference implementation (`onnx/reference/ops/op_linear_attention.py`):

- query [B, T, H_q * d_k], key [B, T, H_kv * d_k], value [B, T, H_kv * d_v]
  (heads packed in the last axis); d_k = query.shape[-1] / q_num_heads.
- past_state / present_state (B, H_kv, d_k, d_v), K-major, type S: the
  present state has past_state's dtype, or query's dtype when past_state is
  absent (the reference's rule; the recurrence itself runs in float32).
- decay (B, T, H_kv) per head or (B, T, H_kv * d_k) per key, log space;
  present exactly for "gated" / "gated_delta" (the spec forbids it otherwise).
- beta (B, T, H_kv) or (B, T, 1) (shared by all heads); present exactly for
  "delta" / "gated_delta".
- GQA: q_num_heads a positive multiple of kv_num_heads; query head j reads
  state head j // (q_num_heads / kv_num_heads).
- scale 0.0 (default) means 1 / sqrt(d_k); chunk_size is a hint (any int).
- T (query, key, value, decay, beta): float32, float16 or bfloat16, one dtype;
  output in T.

Inputs are NumPy arrays or torch tensors; outputs come back in the kind of
`query`. A call the operator rejects raises `deltarule.ContractError` (a
`ValueError`, as the reference raises) naming the ONNX input or attribute.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..api import finite_float32
from ..api import call as _call
from ..errors import ContractError
from ._convert import Kind, dtype_name

__all__ = ["linear_attention"]

RULES = ("linear", "gated", "delta", "gated_delta")
GATED = ("gated", "gated_delta")
DELTA = ("delta", "gated_delta")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOATS = "float32, float16 or bfloat16"


def past_state_of(kind: Kind, past_state, q: torch.Tensor, B: int, Hkv: int, d_k: int, d_v: int):
    """The checked `past_state` in float32 (or None) and the type S of `present_state`:
    past_state's dtype, or the query's when it is absent."""
    s = kind.tensor("past_state", past_state)
    if s is None:
        return None, q.dtype
    if tuple(s.shape) != (B, Hkv, d_k, d_v):
        raise ContractError("past_state", f"(B, kv_num_heads, d_k, d_v) = ({B}, {Hkv}, {d_k}, {d_v})",
                            f"shape {list(s.shape)}")
    if s.dtype not in FLOAT_DTYPES:
        raise ContractError("past_state", f"dtype {_FLOATS} (type S)", dtype_name(s.dtype))
    if s.device != q.device:
        raise ContractError("past_state", f"device {q.device} (query's)", s.device)
    return s.to(torch.float32).contiguous(), s.dtype


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
):
    """ONNX `LinearAttention`-27: returns (output [B, T, H_q * d_v], present_state).

    Args:
        query: [B, T, q_num_heads * d_k], float32 / float16 / bfloat16.
        key: [B, T, kv_num_heads * d_k], query's dtype.
        value: [B, T, kv_num_heads * d_v], query's dtype.
        past_state: optional (B, kv_num_heads, d_k, d_v), float32 / float16 /
            bfloat16 (type S); absent means zeros.
        decay: (B, T, kv_num_heads) or (B, T, kv_num_heads * d_k) log-space
            decay, query's dtype; exactly for "gated" / "gated_delta".
        beta: (B, T, kv_num_heads) or (B, T, 1), query's dtype; exactly for
            "delta" / "gated_delta".
        q_num_heads, kv_num_heads: head counts, q_num_heads a positive
            multiple of kv_num_heads.
        update_rule: "linear" | "gated" | "delta" | "gated_delta" (default).
        scale: 0.0 (default) selects 1 / sqrt(d_k).
        chunk_size: scheduling hint; never changes the result.

    Returns:
        (output, present_state): output (B, T, q_num_heads * d_v) in query's
        dtype; present_state (B, kv_num_heads, d_k, d_v) in past_state's dtype
        (query's when past_state is absent). NumPy in, NumPy out.

    Raises:
        ContractError: any input or attribute the operator rejects.
    """
    return _packed(
        query, key, value, past_state, decay, beta,
        q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, update_rule=update_rule,
        scale=scale, chunk_size=chunk_size, contrib=False,
    )


# ---------------------------------------------------------------------------
# shared with deltarule.contracts.ort.linear_attention (com.microsoft's superset)
# ---------------------------------------------------------------------------

def _packed(query, key, value, past_state, decay, beta, *, q_num_heads, kv_num_heads,
            update_rule, scale, chunk_size, contrib):
    """The [B, T, H*D] LinearAttention family.

    contrib=False: ONNX opset 27 (decay / beta forbidden when the rule has no
    use for them; key has kv_num_heads heads; q_num_heads >= kv_num_heads).
    contrib=True: com.microsoft (unused decay / beta are ignored; key may have
    any head count dividing kv_num_heads; kv_num_heads may exceed q_num_heads).
    """
    kind = Kind("query", query)
    q = kind.tensor("query", query, optional=False)
    k = kind.tensor("key", key, optional=False)
    v = kind.tensor("value", value, optional=False)
    Hq, Hkv, scale = _attributes(update_rule, q_num_heads, kv_num_heads, chunk_size, scale, contrib=contrib)
    d, b = _gate_inputs(kind, decay, beta, update_rule, contrib=contrib)
    _check_types(q, k, v, d, b)
    B, T, d_k, Hk, d_v = _head_sizes(q, k, v, Hq, Hkv, contrib=contrib)
    g, gk = _decay(d, B, T, Hkv, d_k)
    b = _beta(b, B, T, Hkv)
    s, state_dtype = past_state_of(kind, past_state, q, B, Hkv, d_k, d_v)
    q4, k4, v4 = _head_forms(q, k, v, B, T, Hq, Hk, Hkv, d_k, d_v)

    o, state = _call(
        q4, k4, v4, rule=update_rule, g=g, gk=gk, beta=b, scale=scale, initial_state=s,
        chunk_size=chunk_size if chunk_size >= 1 else 64,
        accept_growth=True,  # the runtime takes any log decay; linear_attention refuses > 0
    )
    output = o.reshape(B, T, o.shape[2] * d_v)
    return kind.out(output), kind.out(state.to(state_dtype))


def _attributes(update_rule, q_num_heads, kv_num_heads, chunk_size, scale, *, contrib):
    """update_rule, the head counts (contrib: either may divide the other), chunk_size and
    scale; returns (q_num_heads, kv_num_heads, deltarule's scale)."""
    if not isinstance(update_rule, str) or update_rule not in RULES:
        raise ContractError("update_rule", " | ".join(repr(r) for r in RULES), repr(update_rule))
    Hq = check_int_attr("q_num_heads", q_num_heads, minimum=1)
    Hkv = check_int_attr("kv_num_heads", kv_num_heads, minimum=1)
    if contrib:
        if Hq % Hkv and Hkv % Hq:
            raise ContractError(
                "kv_num_heads", f"a divisor or a multiple of q_num_heads = {Hq}", Hkv)
    elif Hq % Hkv:
        raise ContractError("q_num_heads", f"a positive multiple of kv_num_heads = {Hkv}", Hq)
    check_int_attr("chunk_size", chunk_size)
    return Hq, Hkv, check_scale(scale)


def _gate_inputs(kind: Kind, decay, beta, update_rule, *, contrib):
    """decay and beta as tensors, present exactly for the rules that use them."""
    gating, delta = update_rule in GATED, update_rule in DELTA
    if contrib:                                    # com.microsoft ignores an unused gate
        decay = decay if gating else None
        beta = beta if delta else None
    d = kind.tensor("decay", decay)
    b = kind.tensor("beta", beta)
    check_gate_presence(d, b, update_rule, forbidden=" (the spec forbids it)")
    return d, b


def check_gate_presence(decay, beta, update_rule: str, *, forbidden: str = "") -> None:
    """decay and beta present exactly for the rules that use them: a ContractError naming the
    first that is not (`forbidden` closes the message of a gate the rule does not use)."""
    gating, delta = update_rule in GATED, update_rule in DELTA
    for name, x, needed in (("decay", decay, gating), ("beta", beta, delta)):
        if needed and x is None:
            raise ContractError(name, f"an input for update_rule {update_rule!r}", "absent")
        if not needed and x is not None:
            raise ContractError(name, f"absent for update_rule {update_rule!r}{forbidden}", "a tensor")


def _check_types(q, k, v, d, b) -> None:
    """query, key, value of rank 3; every input of type T in query's dtype and on its device."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dim() != 3:
            raise ContractError(name, "a rank-3 tensor (B, T, H*D)", f"shape {list(x.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ContractError("query", f"dtype {_FLOATS} (type T)", dtype_name(q.dtype))
    for name, x in (("key", k), ("value", v), ("decay", d), ("beta", b)):
        if x is not None and x.dtype != q.dtype:
            raise ContractError(name, f"query's dtype {dtype_name(q.dtype)} (type T)", dtype_name(x.dtype))
        if x is not None and x.device != q.device:
            raise ContractError(name, f"device {q.device} (query's)", x.device)


def _head_sizes(q, k, v, Hq: int, Hkv: int, *, contrib):
    """The packed last axes split into heads: (B, T, d_k, key's head count, d_v)."""
    B, T, q_width = q.shape
    if q_width % Hq or q_width == 0:
        raise ContractError("query", f"last axis a positive multiple of q_num_heads = {Hq}", q_width)
    d_k = q_width // Hq
    k_width, v_width = k.shape[2], v.shape[2]
    if contrib:
        if k_width % d_k or k_width == 0 or Hkv % (k_width // d_k):
            raise ContractError(
                "key", f"(B, T, H_k * d_k) with d_k = {d_k} and H_k dividing kv_num_heads = {Hkv}",
                f"shape {list(k.shape)}")
        Hk = k_width // d_k
    else:
        if k_width != Hkv * d_k:
            raise ContractError("key", f"(B, T, kv_num_heads * d_k) = ({B}, {T}, {Hkv * d_k})",
                                f"shape {list(k.shape)}")
        Hk = Hkv
    if tuple(k.shape[:2]) != (B, T):
        raise ContractError("key", f"(B, T, ...) = ({B}, {T}, ...) as query", f"shape {list(k.shape)}")
    if tuple(v.shape[:2]) != (B, T) or v_width % Hkv or v_width == 0:
        raise ContractError("value", f"(B, T, kv_num_heads * d_v) = ({B}, {T}, {Hkv} * d_v), d_v >= 1",
                            f"shape {list(v.shape)}")
    return B, T, d_k, Hk, v_width // Hkv


def _decay(d, B: int, T: int, Hkv: int, d_k: int):
    """decay per head or per key as deltarule's (g, gk); (None, None) when absent."""
    if d is None:
        return None, None
    if d.dim() != 3 or tuple(d.shape[:2]) != (B, T) or d.shape[2] not in (Hkv, Hkv * d_k):
        raise ContractError(
            "decay", f"(B, T, kv_num_heads) = ({B}, {T}, {Hkv}) or "
            f"(B, T, kv_num_heads * d_k) = ({B}, {T}, {Hkv * d_k})", f"shape {list(d.shape)}")
    if d.shape[2] == Hkv:
        return d, None
    return None, d.reshape(B, T, Hkv, d_k)


def _beta(b, B: int, T: int, Hkv: int):
    """beta per head, a shared (B, T, 1) beta broadcast over the heads; None when absent."""
    if b is None:
        return None
    if b.dim() != 3 or tuple(b.shape[:2]) != (B, T) or b.shape[2] not in (Hkv, 1):
        raise ContractError(
            "beta", f"(B, T, kv_num_heads) = ({B}, {T}, {Hkv}) or (B, T, 1)", f"shape {list(b.shape)}")
    if b.shape[2] != Hkv:
        b = b.expand(B, T, Hkv).contiguous()
    return b


def _head_forms(q, k, v, B: int, T: int, Hq: int, Hk: int, Hkv: int, d_k: int, d_v: int):
    """q, k, v as [B, T, H, D] in a head form deltarule runs."""
    q4 = q.reshape(B, T, Hq, d_k)
    k4 = k.reshape(B, T, Hk, d_k)
    v4 = v.reshape(B, T, Hkv, d_v)
    # deltarule's head forms: GQA needs Hk == Hv, GVA needs Hq == Hk.
    if Hq >= Hkv:
        if Hk != Hkv:                              # com.microsoft: key shared by several kv heads
            k4 = k4.repeat_interleave(Hkv // Hk, dim=2)
    elif Hq != Hk:                                 # inverse GQA with distinct q / k head counts
        L = Hq * Hk // math.gcd(Hq, Hk)
        q4 = q4.repeat_interleave(L // Hq, dim=2)
        k4 = k4.repeat_interleave(L // Hk, dim=2)
    return q4, k4, v4


def check_int_attr(name, x, *, minimum=None, maximum=None, allow_bool=False) -> int:
    """An integer attribute (bool refused unless allow_bool), optionally bounded."""
    if (isinstance(x, bool) and not allow_bool) or not isinstance(x, numbers.Integral):
        raise ContractError(name, "an int", repr(x))
    x = int(x)
    if minimum is not None and x < minimum or maximum is not None and x > maximum:
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ContractError(name, f"an int {bounds}", x)
    return x


def check_scale(scale) -> float | None:
    """The float attribute `scale`: 0.0 selects the default (None for deltarule)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ContractError("scale", "a float", repr(scale))
    if not finite_float32(scale):
        raise ContractError("scale", "a float finite in float32 (deltarule's kernels compute in float32)", scale)
    return None if scale == 0 else float(scale)

"""`com.microsoft.LinearAttention` (onnxruntime 1.32) on top of deltarule: ONNX's
`LinearAttention` with ONNX Runtime's extensions (`contracts.onnx_linear_attention._packed(contrib=True)`)
and the `state_window` attribute (per-token states of the last W tokens). The public name
lives in `deltarule.contracts.ort`."""

from __future__ import annotations

import torch

from ..errors import ContractError
from ._convert import Kind, dtype_name
from .onnx_linear_attention import DELTA, FLOAT_DTYPES, GATED, RULES, _packed, check_int_attr

# state_window's range in the schema ("Valid range is [0, 8]"; ORT's shape inference refuses others)
MAX_STATE_WINDOW = 8


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

    ONNX `LinearAttention` (see `deltarule.contracts.onnx_linear_attention.linear_attention`) with ONNX
    Runtime's extensions and leniencies:

    - inverse GQA: kv_num_heads may be a positive multiple of q_num_heads; value head h
      then reads query head h // (kv_num_heads / q_num_heads) and the output has
      max(q_num_heads, kv_num_heads) heads;
    - key's head count H_k = key.shape[-1] / d_k is read from its shape and may be any
      divisor of kv_num_heads (kv head h reads key head h // (kv_num_heads / H_k));
    - a decay or beta that the update rule does not use is ignored (ONNX forbids it);
    - state_window W in [0, 8] (ORT's CPU kernel refuses W > 0: CUDA only).

    Args:
        query: [B, T, H_q * d_k], float32 / float16 / bfloat16.
        key: [B, T, H_k * d_k], query's dtype.
        value: [B, T, H_kv * d_v], query's dtype.
        past_state: optional, type S (float32 / float16 / bfloat16): [B, H_kv, d_k, d_v],
            or with W > 0 [W, B, H_kv, d_k, d_v] of which only slot W - 1 is read.
            Absent: zeros. Not modified.
        decay: [B, T, H_kv] or [B, T, H_kv * d_k] log-space decay, query's dtype.
        beta: [B, T, H_kv] or [B, T, 1], query's dtype.
        q_num_heads, kv_num_heads: head counts, one a positive multiple of the other.
        update_rule: "linear" | "gated" | "delta" | "gated_delta" (default).
        scale: 0.0 (default) selects 1 / sqrt(d_k).
        chunk_size: scheduling hint, default 64; never changes the result.
        state_window: W, default 0.

    Returns:
        output: [B, T, max(H_q, H_kv) * d_v] in query's dtype.
        present_state: in past_state's dtype (query's when past_state is absent);
            [B, H_kv, d_k, d_v] when W = 0; with W > 0 [W, B, H_kv, d_k, d_v], right
            aligned: slot j holds the state after token T - W + j (0-based), so slot W - 1
            is the state after the last token, and the slots j < W - T, which hold no
            token of this call, are zeros (the schema's rule; with T = 0 that is every
            slot, slot W - 1 included).

    Raises:
        ContractError: any input or attribute the operator rejects, before any work.
    """
    W = check_int_attr("state_window", state_window, minimum=0, maximum=MAX_STATE_WINDOW)
    attrs = dict(q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, update_rule=update_rule, scale=scale,
                 chunk_size=chunk_size, contrib=True)
    if W == 0:
        return _packed(query, key, value, past_state, decay, beta, **attrs)
    return _windowed(query, key, value, past_state, decay, beta, W, attrs)


def _windowed(query, key, value, past_state, decay, beta, W: int, attrs: dict):
    """state_window W > 0: the tokens before the window in one call, then each window token in
    a call of its own whose final state is that token's slot; the float32 state is carried
    from call to call (one rounding to S at the end, as a single pass would store it)."""
    kind = Kind("query", query)
    q, k, v = (kind.tensor(n, x, optional=False) for n, x in (("query", query), ("key", key), ("value", value)))
    d, b = kind.tensor("decay", decay), kind.tensor("beta", beta)
    rule = attrs["update_rule"]
    d = d if rule in GATED else None               # com.microsoft ignores a gate the rule does not use
    b = b if rule in DELTA else None
    sizes = _window_sizes(q, k, v, d, b, attrs)
    if sizes is None:                              # the full call's own checks name what is wrong
        _packed(q, k, v, None, d, b, **attrs)
        raise AssertionError("unreachable: the inputs were found inconsistent")
    B, T, Hkv, d_k, d_v = sizes
    s, S = _window_past_state(kind, past_state, q, W, B, Hkv, d_k, d_v)

    def part(t0, t1, state):
        cut = lambda x: None if x is None else x[:, t0:t1]          # noqa: E731
        return _packed(cut(q), cut(k), cut(v), state, cut(d), cut(b), **attrs)

    slots = torch.zeros((W, B, Hkv, d_k, d_v), dtype=torch.float32, device=q.device)
    first = max(0, T - W)                          # the window's first token
    outputs = []
    if first > 0 or T == 0:                        # (T = 0: an empty output of the right shape)
        o, s = part(0, first, s)
        outputs.append(o)
    for t in range(first, T):
        o, s = part(t, t + 1, s)
        outputs.append(o)
        slots[t - (T - W)] = s
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return kind.out(output), kind.out(slots.to(S))


def _window_sizes(q, k, v, d, b, attrs: dict):
    """(B, T, H_kv, d_k, d_v) when the rule is one of RULES, every input is a rank-3 tensor
    over query's (B, T) and the head counts divide the widths (so that cutting the token axis
    keeps a valid call); None otherwise (the full call is then checked, to raise the
    operator's error)."""
    Hq, Hkv = (check_int_attr(n, attrs[n], minimum=1) for n in ("q_num_heads", "kv_num_heads"))
    if not isinstance(attrs["update_rule"], str) or attrs["update_rule"] not in RULES:
        return None
    tensors = [x for x in (q, k, v, d, b) if x is not None]
    if any(x.dim() != 3 or tuple(x.shape[:2]) != tuple(q.shape[:2]) for x in tensors):
        return None
    if q.shape[2] == 0 or q.shape[2] % Hq or v.shape[2] == 0 or v.shape[2] % Hkv:
        return None
    return q.shape[0], q.shape[1], Hkv, q.shape[2] // Hq, v.shape[2] // Hkv


def _window_past_state(kind: Kind, past_state, q: torch.Tensor, W: int, B: int, Hkv: int, d_k: int, d_v: int):
    """(slot W - 1 of past_state as float32, zeros when absent; the type S of present_state)."""
    s = kind.tensor("past_state", past_state)
    if s is None:
        return torch.zeros((B, Hkv, d_k, d_v), dtype=torch.float32, device=q.device), q.dtype
    if tuple(s.shape) != (W, B, Hkv, d_k, d_v):
        raise ContractError("past_state", f"(W, B, kv_num_heads, d_k, d_v) = ({W}, {B}, {Hkv}, {d_k}, {d_v}) "
                            f"with state_window = {W}", f"shape {list(s.shape)}")
    if s.dtype not in FLOAT_DTYPES:
        raise ContractError("past_state", "dtype float32, float16 or bfloat16 (type S)", dtype_name(s.dtype))
    if s.device != q.device:
        raise ContractError("past_state", f"device {q.device} (query's)", s.device)
    return s[W - 1].to(torch.float32).contiguous(), s.dtype

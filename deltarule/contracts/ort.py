"""ONNX Runtime's contrib operators (domain `com.microsoft`, onnxruntime 1.32) on top of deltarule.

- `gated_delta_net`: `com.microsoft.GatedDeltaNet` — token-major (T, H, D) with
  optional `cu_seqlens`, or (B, S, H, D); V-major float32 state
  (B, H_v, d_v, d_k); value heads a multiple of query heads; fused gate
  (`gate_activation`), beta sigmoid and in-kernel L2 norm (eps 1e-12); compact
  state-update capture (`state_update_capacity`, `capture_count`,
  `state_update_active`) through deltarule's `capture=`.
- `linear_attention`: `com.microsoft.LinearAttention` — ONNX `LinearAttention`
  plus inverse GQA (kv_num_heads a multiple of q_num_heads), a key with any
  head count dividing kv_num_heads, and per-token state windows (`state_window`).
- `linear_attention_gate`: `com.microsoft.LinearAttentionGate` — the fused
  gate `decay = decay_scale * softplus(a + dt_bias)`, `beta = sigmoid(b)`,
  i.e. `deltarule.gate`.
- `causal_conv_with_state`: `com.microsoft.CausalConvWithState` — the stateful
  causal depthwise convolution (ndim 1 to 3, dilation, channels-last layouts,
  state windows and the extended channel / state attributes).

Behaviour follows onnxruntime 1.32's CPU execution provider where it runs the
call, and the operator schema's text where that kernel refuses (CUDA-only
features; docs/contracts.md lists which and how each is checked). Inputs are
NumPy arrays or torch tensors; outputs come back in the kind of the first
input. A call the operator rejects, or whose meaning the schema leaves open,
raises `deltarule.ContractError` naming the ORT input or attribute.

The implementations live in `_ort_gdn.py`, `_ort_la.py` and `_ort_conv.py`.
"""

from __future__ import annotations

from ..gate import gate as _gate
from ._convert import Kind
from ._ort_conv import causal_conv_with_state
from ._ort_gdn import L2NORM_EPS, gated_delta_net, gated_delta_net_arguments
from ._ort_la import linear_attention

__all__ = ["gated_delta_net", "gated_delta_net_arguments", "linear_attention", "linear_attention_gate",
           "causal_conv_with_state", "L2NORM_EPS"]


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

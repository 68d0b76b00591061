"""`causal_conv1d_with_state`: the short causal convolution of one call with a dense state
(ONNX's ``CausalConvWithState``), `conv1d_with_state` (its eager form on checked arguments,
the implementation of the op ``deltarule::causal_conv1d_with_state`` that
`deltarule.conv.custom_ops` registers) and its argument checks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ContractError
from .checks import ACTIVATIONS, INPUT_TYPES, check_tensor


def causal_conv1d_with_state(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             state: torch.Tensor | None = None, *, activation: str | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The short causal convolution of one call with a dense state: ONNX's ``CausalConvWithState``
    (opset 27), and what `deltarule.onnx.export` turns a model's convolution into.

    Args:
        x: [B, C, T] float32 / bfloat16 / float16, the input, channels first.
        weight: [C, W] (or ONNX's [C, 1, W]), x's dtype: one kernel of width W per channel.
        bias: [C] or None (default).
        state: [B, C, W - 1], x's dtype: the W - 1 inputs before x's first token (oldest first);
            None (default): zeros. Not modified.
        activation: None (default) or "silu".

    Returns:
        (y [B, C, T] in x's dtype, new_state [B, C, W - 1]: the last W - 1 inputs of
        (state, x)). The arithmetic is float32.

    Traced (`torch.compile`, `torch.export`) the call is one op, ``deltarule::causal_conv1d_with_state``.

    Example::

        >>> import torch
        >>> from deltarule.conv import causal_conv1d_with_state
        >>> x = torch.arange(6.).reshape(1, 1, 6)
        >>> y, s = causal_conv1d_with_state(x, torch.ones(1, 3), state=torch.full((1, 1, 2), 10.))
        >>> y.tolist(), s.tolist()
        ([[[20.0, 11.0, 3.0, 6.0, 9.0, 12.0]]], [[[4.0, 5.0]]])
    """
    _check_with_state(x, weight, bias, state, activation)
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if torch.compiler.is_compiling():          # the op deltarule.conv.custom_ops registers
        return torch.ops.deltarule.causal_conv1d_with_state.default(x, weight, bias, state, activation)
    return conv1d_with_state(x, weight, bias, state, activation)


def conv1d_with_state(x, weight, bias, state, activation):
    """`causal_conv1d_with_state` on checked arguments (weight [C, W]): torch's grouped conv1d
    over (state, x) in float32."""
    B, C, T = x.shape
    W = weight.shape[-1]
    prior = x.new_zeros(B, C, W - 1) if state is None else state
    # float32 before the concatenation: a float32 state beside a 16-bit x is not rounded to x's dtype
    full = torch.cat((prior.float(), x.float()), dim=-1)
    if C and T:
        y = F.conv1d(full, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=C)
        if activation == "silu":
            y = F.silu(y)
    else:                              # F.conv1d takes neither 0 groups nor an input shorter than W
        y = x.new_empty(B, C, T)       # no outputs; the new state below is still (state, x)'s last W - 1
    return y.to(x.dtype), full[..., full.shape[-1] - (W - 1):].to(prior.dtype).clone()


def _check_with_state(x, weight, bias, state, activation):
    """`causal_conv1d_with_state`'s argument checks, every one before any work (ContractError)."""
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ContractError("activation", " | ".join(repr(a) for a in ACTIVATIONS), repr(activation))
    check_tensor("x", x, 3, INPUT_TYPES, "[B, C, T]")
    B, C = x.shape[0], x.shape[1]
    flat = weight.squeeze(1) if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] == 1 \
        else weight
    W = max(flat.shape[-1], 1) if isinstance(flat, torch.Tensor) and flat.dim() == 2 else 1
    # every tensor on x's device: torch would raise its own RuntimeError mid-call otherwise
    check_tensor("weight", flat, 2, INPUT_TYPES, f"[C, W] or [C, 1, W] with C = {C}, W >= 1", x.device, (C, W))
    if bias is not None:
        check_tensor("bias", bias, 1, INPUT_TYPES, f"[C] = [{C}] or None", x.device, (C,))
    if state is not None:
        check_tensor("state", state, 3, INPUT_TYPES, f"[B, C, W - 1] = [{B}, {C}, {W - 1}] or None", x.device,
                (B, C, W - 1))

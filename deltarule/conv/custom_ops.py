"""The short convolution as a torch custom op (`torch.library`): ``deltarule::causal_conv1d_with_state``,
what `torch.compile` and `torch.export` see of a `causal_conv1d_with_state` call, so an
exported model holds the conv as one op (ONNX's ``CausalConvWithState``; `deltarule.onnx.export`).
Registered when `deltarule.conv` is imported, which `import deltarule` does; linear attention's
ops are `deltarule.custom_ops`'.

The implementation is the eager `conv1d_with_state` (arguments checked before the op: weight
[C, W]); the fake gives the outputs' shapes and dtypes from the inputs' alone.
"""

from __future__ import annotations

import torch

from .with_state import conv1d_with_state

# a fragment of the deltarule namespace: its one "DEF" library is deltarule.custom_ops'
_LIB = torch.library.Library("deltarule", "FRAGMENT")
_LIB.define("causal_conv1d_with_state(Tensor x, Tensor weight, Tensor? bias, Tensor? state, str? activation) "
            "-> (Tensor, Tensor)")


def _conv_with_state_fake(x, weight, bias, state, activation):
    B, C = x.shape[0], x.shape[1]
    # the new state in the state's dtype (x's without one), as `conv1d_with_state` returns it
    return torch.empty_like(x), (x if state is None else state).new_empty(B, C, weight.shape[-1] - 1)


_LIB.impl("causal_conv1d_with_state", conv1d_with_state, "CompositeExplicitAutograd")
torch.library.register_fake("deltarule::causal_conv1d_with_state", _conv_with_state_fake, lib=_LIB)

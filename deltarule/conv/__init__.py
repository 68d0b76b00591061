"""The short causal convolution of the hybrid models' linear layers, over packed sequences
with a conv-state slab (a serving engine's per-request rolling input history).

Each sequence n of a call reads its prior inputs (the last W - 1 inputs before its first
token) from a slab row, convolves, and writes its new history back to a slab row: every
read of a call happens before any write, rows not addressed stay bit-identical. Two
history conventions, both vLLM's:

- plain (prefill / decode): the prior is columns [0, W - 1) of the row; afterwards those
  columns hold the last W - 1 inputs of (prior, tokens).
- rolling (speculative decoding, a row of S = W - 1 + num_spec columns): the prior is
  columns [a - 1, a - 1 + W - 1) with a the sequence's accepted-token count (the W - 1
  inputs ending at the last accepted token); afterwards columns [0, W - 2 + L) hold the
  prior's last W - 2 inputs followed by the sequence's L tokens, so that the next step's
  prior for a' accepted tokens is again columns [a' - 1, a' - 1 + W - 1) (vLLM's GPU
  ``causal_conv1d_update``; columns past W - 2 + L are left as they are).

`plan_conv` turns the layout into gather indices once (a serving step builds it once for
every layer); `causal_conv1d_slab` runs one call; `reference_conv1d_slab` is its float64
twin, a loop over sequences.

`causal_conv1d_with_state` is the convolution of one call with a dense state instead (ONNX's
``CausalConvWithState``, what `deltarule.onnx.export` turns a model's convolution into),
traced as one op, ``deltarule::causal_conv1d_with_state``.

Modules: `plan` (`ConvPlan`, `plan_conv`), `slab` (`causal_conv1d_slab`, `KeptConv`),
`reference` (`reference_conv1d_slab`), `with_state` (`causal_conv1d_with_state`,
`conv1d_with_state`), `custom_ops` (the op, registered on import), `checks` (the tensor
argument checks slab and with_state share).
"""

from . import custom_ops  # noqa: F401 - registers deltarule::causal_conv1d_with_state
from .plan import ConvPlan, plan_conv
from .reference import reference_conv1d_slab
from .slab import KeptConv, causal_conv1d_slab
from .with_state import causal_conv1d_with_state, conv1d_with_state

__all__ = ["ConvPlan", "KeptConv", "causal_conv1d_slab", "causal_conv1d_with_state", "conv1d_with_state",
           "plan_conv", "reference_conv1d_slab"]

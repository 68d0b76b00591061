"""Adapters reproducing other runtimes' contracts on top of `deltarule.linear_attention`.

- `deltarule.contracts.onnx_linear_attention`: ONNX `LinearAttention` (opset 27).
- `deltarule.contracts.ort`: ONNX Runtime 1.32's `com.microsoft.GatedDeltaNet`
  (compact state-update capture included), `com.microsoft.LinearAttention`
  (state windows), `com.microsoft.CausalConvWithState` and
  `com.microsoft.LinearAttentionGate` (GatedDeltaNet in `_ort_gdn.py`, windows in
  `_ort_la.py`, the conv in `_ort_conv.py`).
- `deltarule.contracts.fla`: flash-linear-attention's Python API.
- `deltarule.contracts.ascend`: Ascend's `aclnnRecurrentGatedDeltaRule`
  (packed tokens, per-token rows of a V-major slab updated in place,
  speculative decoding's `num_accepted_tokens`).
- `deltarule.contracts.slab`: the `gatedDeltaUpdate` slab operator (a float32
  K-major slab addressed by `slot_ids`, updated in place; raw-gate form).

Each submodule (`deltarule.contracts.fla`, ...) is imported explicitly by the caller;
importing this package loads none of them. See docs/contracts.md.
"""

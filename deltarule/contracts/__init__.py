"""Adapters reproducing other runtimes' contracts on top of `deltarule.linear_attention`.

- `deltarule.contracts.onnx`: ONNX `LinearAttention` (opset 27).
- `deltarule.contracts.ort`: ONNX Runtime `com.microsoft.GatedDeltaNet`,
  `com.microsoft.LinearAttention` and `com.microsoft.LinearAttentionGate`.
- `deltarule.contracts.fla`: flash-linear-attention's Python API.
- `deltarule.contracts.ascend`: Ascend's `aclnnRecurrentGatedDeltaRule`
  (packed tokens, per-token rows of a V-major slab updated in place,
  speculative decoding's `num_accepted_tokens`).
- `deltarule.contracts.slab`: the `gatedDeltaUpdate` slab operator (a float32
  K-major slab addressed by `slot_ids`, updated in place; raw-gate form).

Each submodule (`deltarule.contracts.fla`, ...) is imported explicitly by the caller;
importing this package loads none of them. See docs/contracts.md.
"""

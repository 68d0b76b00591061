"""Adapters reproducing other runtimes' contracts on top of `deltarule.linear_attention`.

- `deltarule.contracts.onnx`: ONNX `LinearAttention` (opset 27).
- `deltarule.contracts.ort`: ONNX Runtime `com.microsoft.GatedDeltaNet`,
  `com.microsoft.LinearAttention` and `com.microsoft.LinearAttentionGate`.
- `deltarule.contracts.fla`: flash-linear-attention's Python API.

Each submodule (`deltarule.contracts.fla`, ...) is imported explicitly by the caller;
importing this package loads none of them. See docs/contracts.md.
"""

"""Whole models out of Python: a transformers hybrid checkpoint as an ONNX decoder whose
linear-attention layers are fused nodes (docs/export.md).

- `export_model(model_dir, out_dir, *, target="ort", dtype="fp32", quantization=None)` -> `Exported`;
  also ``deltarule export onnx MODEL_DIR OUT_DIR [--dtype q4 ...]``.
- `quantize`: transformers.js's dtype names, their files, onnxruntime's weight-only quantizer.
- `decoder`: the traced function of plain tensors and its `StateLayout` (the names).
- `translate`: deltarule's ops as ONNX nodes; `graph`: the target's final form and checks.

Needs ``onnx``, ``onnxscript`` (torch.onnx's exporter) and transformers >= 5.25.
"""

from .exporter import Exported, export_model
from .quantize import Quantization

__all__ = ["export_model", "Exported", "Quantization"]

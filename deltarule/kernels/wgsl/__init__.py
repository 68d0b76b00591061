"""WGSL compute shaders through WebGPU (wgpu-py): the recurrence, the chunked prefill
(`chunked`) and the fused gate.

Templates (`*.wgsl.jinja`) are specialized per head size, head grouping,
state layout, input dtypes and flags, compiled once per specialization and
cached. Import is cheap: the adapter is requested on first use.
"""

from ._device import unavailable_reason
from .gate import fused_gate
from .recurrent import recurrence

__all__ = ["fused_gate", "recurrence", "unavailable_reason"]

"""deltarule and ONNX: the `ai.deltarule::LinearAttention` op and a runner that computes
linear-attention nodes with deltarule.

- `ai.deltarule::LinearAttention` (ops.py): ONNX LinearAttention-27 plus the
  Gated DeltaNet-2 `erase_gate` / `write_gate` inputs, shipped with an ONNX
  function body (a `Scan` of standard ops) so any ONNX runtime can run it:
  `make_node`, `make_function`, `attach_functions`, `make_model`, `expand`,
  `Config`;
  `linear_attention` computes it with deltarule.
- `run(model, feeds)` / `Session(model)` (runner.py): evaluate a model in ONNX
  Runtime with every linear-attention node (`LinearAttention`-27,
  `com.microsoft.GatedDeltaNet`, `com.microsoft.LinearAttention`,
  `ai.deltarule::LinearAttention`, and the `com.microsoft.CausalConvWithState`
  nodes ONNX Runtime's CPU kernel refuses) computed by deltarule instead. The feeds are
  checked against the graph's declared inputs first, as ONNX Runtime checks them
  (`feeds.Inputs`: names, element type, rank, static dimensions; `ContractError`
  naming the input).

Needs the `onnx` package (and `onnxruntime` for `run` / `Session`). See docs/onnx.md.
"""

try:
    import onnx as _onnx  # noqa: F401  (the top-level package, not this one)
except ImportError as exc:                        # pragma: no cover - depends on the environment
    raise ImportError("deltarule.onnx needs the 'onnx' package: pip install onnx") from exc

from .custom_op import (
    DOMAIN,
    GATE_FORMS,
    INPUTS,
    OP_TYPE,
    OUTPUTS,
    VERSION,
    Config,
    attach_functions,
    expand,
    is_deltarule_node,
    linear_attention,
    make_function,
    make_model,
    make_node,
)
from .runner import (
    LINEAR_ATTENTION_OPS,
    PARTIAL_OPS,
    Session,
    computed_by_deltarule,
    is_linear_attention_node,
    run,
)

__all__ = [
    "DOMAIN", "OP_TYPE", "VERSION", "INPUTS", "OUTPUTS", "GATE_FORMS", "Config",
    "make_function", "make_node", "make_model", "attach_functions", "expand", "is_deltarule_node",
    "linear_attention", "run", "Session", "LINEAR_ATTENTION_OPS", "PARTIAL_OPS", "is_linear_attention_node",
    "computed_by_deltarule",
]

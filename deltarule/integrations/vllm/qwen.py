"""Qwen3-Next / Qwen3.5 (and every model built of ``QwenGatedDeltaNetAttention``): the
function behind vLLM-CPU's custom op ``vllm::cpu_gdn_attention_core``
(``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``), the whole core of the layer on
CPU, on deltarule.

The op is registered when the first GDN layer is built, with the function the module holds
then: `hook` replaces that module function before, with the op's name and schema kept (vLLM
infers the schema from the function's annotations, taken from the original's). The layer is a
vLLM ``PluggableLayer`` that an out-of-tree class could replace whole, but its CPU forward
(projections, the op, the output norm) would then be a copy of vLLM's: only the op's function
is deltarule's.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import typing

import torch

from .core import CPU_GDN_MODULE, run_core, vllm_functions

# tested; the op's function serves every model built of the layer (Qwen3.5's multimodal classes,
# InternS2-Mobius, Qwen4-Exp in vLLM 0.32) as well
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
HOOKED_MODULE = CPU_GDN_MODULE
HOOKED_FUNCTION = "cpu_gdn_attention_core"
_SIGNATURE = ("mixed_qkv", "b", "a", "core_attn_out", "layer_name")
_USED = ("_CPU_GDN_ATTENTION_OPS_REGISTERED", "register_cpu_gdn_attention_ops", "_unpacked_conv_weight")

log = logging.getLogger("deltarule.integrations.vllm")


def refusal() -> str | None:
    """Why the op's function cannot be hooked in this process (None: it can, or it is)."""
    try:
        module = importlib.import_module(HOOKED_MODULE)
    except Exception as e:  # noqa: BLE001 - any import failure means: not hookable here
        return f"{HOOKED_MODULE} does not import ({type(e).__name__}: {e})"
    function = getattr(module, HOOKED_FUNCTION, None)
    if function is None or any(not hasattr(module, name) for name in _USED):
        return f"{HOOKED_MODULE} lacks {HOOKED_FUNCTION} or one of {_USED}"
    if function is not gdn_attention_core and tuple(inspect.signature(function).parameters) != _SIGNATURE:
        return f"{HOOKED_FUNCTION}'s parameters changed: {tuple(inspect.signature(function).parameters)}"
    if not hooked() and module._CPU_GDN_ATTENTION_OPS_REGISTERED:
        return (f"vLLM registered {HOOKED_FUNCTION} before enable() in this process: call enable() before "
                "the engine builds the model, or set DELTARULE_VLLM=1")
    return None


def hook() -> None:
    """Replace the op's module function (after `refusal` said None; a second call does nothing)."""
    if hooked():                                 # hooked before in this process (maybe wrapped since)
        return
    module = importlib.import_module(HOOKED_MODULE)
    original = getattr(module, HOOKED_FUNCTION)
    module._deltarule_original = original
    setattr(module, HOOKED_FUNCTION, adopt_schema(gdn_attention_core, original))
    log.info("deltarule: vLLM's Gated DeltaNet layers run on deltarule (%s.%s)", HOOKED_MODULE, HOOKED_FUNCTION)


def hooked() -> bool:
    """True when this process's vLLM GDN op will run deltarule."""
    try:
        module = importlib.import_module(HOOKED_MODULE)
    except Exception:  # noqa: BLE001 - no vLLM (or not its CPU build): nothing hooked
        return False
    return hasattr(module, "_deltarule_original")


def adopt_schema(function, original):
    """`function` annotated as `original` (resolved in its module): vLLM infers the custom op's
    schema from the annotations of the function it registers. Returns `function`."""
    function.__annotations__ = {**typing.get_type_hints(original), "return": None}
    return function


def gdn_attention_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                       layer_name) -> None:
    """vLLM's ``cpu_gdn_attention_core`` on deltarule: fills ``core_attn_out`` [tokens, Hv, V] and
    updates the layer's conv-state and state slabs (``layer.kv_cache``) in place.

    mixed_qkv: [tokens, 2 Hk K + Hv V] the in-projection (before the convolution); b, a:
    [tokens, Hv] raw beta and decay gates; any float dtype vLLM runs (float32, bfloat16,
    float16), unlike vLLM's own CPU path (bfloat16 only).
    """
    v = vllm_functions()
    context = v.get_forward_context()
    layer = context.no_compile_layers[v.resolve_layer_name(layer_name)]
    run_core(layer, mixed_qkv, b, a, core_attn_out, qwen_gates, context=context)


def qwen_gates(layer, b, a) -> dict:
    """Qwen3-Next / Qwen3.5: decay -exp(A_log) softplus(a + dt_bias) per head, beta = sigmoid(b),
    both in the kernel (`b`, `a`: [T, Hv], this part's tokens)."""
    return dict(g=a[None], A_log=layer.A_log, dt_bias=layer.dt_bias, beta=b[None], beta_sigmoid=True)

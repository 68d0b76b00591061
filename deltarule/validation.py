"""Validation of a `linear_attention` call: every argument checked, defaults filled, the
`Problem` every backend runs. Below the engine and the ops (`deltarule.engine`,
`deltarule.custom_ops`); `deltarule.validate` is `validate`."""

from __future__ import annotations

import math
import numbers
import struct

import torch

from . import aliasing, arguments
from . import batch as _batch
from .batch import BatchPlan
from .errors import ContractError, positive_log_decay
from .problem import (
    DELTA_RULES,
    DeviceSlab,
    GATED_RULES,
    INPUT_DTYPES,
    LAYOUTS,
    RULES,
    STATE_DTYPES,
    Problem,
    differentiable_inputs,
)

_DTYPE_NAMES = "float32, float16 or bfloat16"
_FLOAT32 = struct.Struct("f")
_FLOAT32_MAX = torch.finfo(torch.float32).max


def validate(
    q, k, v, *, rule="gated_delta", g=None, gk=None, beta=None, erase=None, write=None,
    scale=None, initial_state=None, state_layout="kv", cu_seqlens=None, seq_lens=None,
    state_indices=None, num_accepted_tokens=None, plan=None, qk_l2norm=False, l2norm_eps=1e-6, A_log=None,
    dt_bias=None, beta_sigmoid=False, chunk_size=64, capture=None, accept_growth=False,
) -> Problem:
    """Check every argument of `linear_attention`; return the `Problem`.

    Raises `ContractError` on the first invalid argument. Without `plan`,
    reads `cu_seqlens`, `seq_lens`, `state_indices` and `num_accepted_tokens`
    to the host (`deltarule.batch.build`), and `g` / `gk` (their sign) unless
    `accept_growth`; touches nothing else.

    `accept_growth=True` accepts positive log decays (a state that grows):
    the contract adapters of runtimes that accept them (ONNX, ONNX Runtime,
    Ascend, the slab API, fla) pass it; `linear_attention` refuses them.
    Run the result with `deltarule.backends.dispatch(problem, backend)`.
    """
    # The checks run in this order (the first invalid argument is the one reported); later
    # groups read the sizes and the batch layout that earlier ones established.
    B, T, Hq, Hk, Hv, K, V = _check_operands(q, k, v)
    device = q.device
    _check_gates(rule, g=g, gk=gk, beta=beta, erase=erase, write=write, B=B, T=T, Hv=Hv, K=K, V=V, device=device)
    scale = _check_scale(scale, K)
    slab = state_indices is not None or (isinstance(plan, BatchPlan) and plan.in_place)
    num_slots = _check_state(initial_state, state_layout, slab=slab, device=device)
    plan = _check_batch(plan, B=B, T=T, device=device, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                        state_indices=state_indices, num_accepted_tokens=num_accepted_tokens, num_slots=num_slots)
    N = plan.N
    if initial_state is not None:
        _check_state_shape(initial_state, state_layout, slab=slab, N=N, Hv=Hv, K=K, V=V)
    _check_flags(rule, qk_l2norm=qk_l2norm, l2norm_eps=l2norm_eps, beta_sigmoid=beta_sigmoid)
    _check_raw_gate(A_log, dt_bias, g=g, gk=gk, Hv=Hv, K=K, device=device)
    _check_chunk_size(chunk_size)
    if slab and isinstance(initial_state, torch.Tensor):
        aliasing.check_written("initial_state", initial_state,
                               _read_inputs(q, k, v, g, gk, beta, erase, write, A_log, dt_bias))
    if not accept_growth and A_log is None:
        _check_log_decay(g=g, gk=gk)

    requires_grad = torch.is_grad_enabled() and _needs_grad(
        *differentiable_inputs(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state))
    if requires_grad:
        _check_differentiable(plan)
    if capture is not None:
        plan = _check_capture(capture, plan, requires_grad=requires_grad, N=N, Dw=Hv * K if gk is not None else Hv,
                              step=Hk * K + Hv * V, device=device, inputs=(
                                  *_read_inputs(q, k, v, g, gk, beta, erase, write, A_log, dt_bias),
                                  ("initial_state", initial_state if isinstance(initial_state, torch.Tensor)
                                   else None)))

    return Problem(
        q=q, k=k, v=v, rule=rule, g=g, gk=gk, beta=beta, erase=erase, write=write,
        scale=float(scale), initial_state=initial_state, state_layout=state_layout,
        plan=plan, qk_l2norm=qk_l2norm, l2norm_eps=float(l2norm_eps), A_log=A_log, dt_bias=dt_bias,
        beta_sigmoid=beta_sigmoid, chunk_size=int(chunk_size), capture=capture,
        B=B, T=T, Hq=Hq, Hk=Hk, Hv=Hv, K=K, V=V, G=max(Hq // Hv, 1), Ho=max(Hq, Hv),
        state_dtype=initial_state.dtype if isinstance(initial_state, torch.Tensor) else torch.float32,
        device=device, requires_grad=requires_grad, accept_growth=bool(accept_growth),
    )


# --- the operands q, k, v --------------------------------------------------------

def _check_operands(q, k, v) -> tuple[int, int, int, int, int, int, int]:
    """q [B, T, Hq, K], k [B, T, Hk, K], v [B, T, Hv, V]: one dtype, q's device, a head form
    deltarule runs (GVA: Hq == Hk; GQA: Hv == Hk). Returns (B, T, Hq, Hk, Hv, K, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, rank=4, dtypes=INPUT_DTYPES, dtype_names=_DTYPE_NAMES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ContractError("k, v", f"q's dtype {q.dtype}", f"k {k.dtype}, v {v.dtype}")
    B, T, Hq, K = q.shape
    Hk, Hv, V = k.shape[2], v.shape[2], v.shape[3]
    if Hq < 1 or K < 1:
        raise ContractError("q", "[B, T, Hq, K] with Hq, K >= 1", tuple(q.shape))
    if tuple(k.shape) != (B, T, Hk, K) or Hk < 1:
        raise ContractError("k", f"[B, T, Hk, K] = [{B}, {T}, Hk >= 1, {K}]", tuple(k.shape))
    if tuple(v.shape[:2]) != (B, T) or Hv < 1 or V < 1:
        raise ContractError("v", f"[B, T, Hv, V] = [{B}, {T}, Hv >= 1, V >= 1]", tuple(v.shape))
    if Hv % Hk:
        raise ContractError("v", f"Hv a multiple of Hk = {Hk}", f"Hv = {Hv}")
    if Hq != Hk and not (Hv == Hk and Hq % Hv == 0):
        raise ContractError(
            "q", f"Hq == Hk = {Hk} (GVA) or Hq a multiple of Hv == Hk (GQA)",
            f"Hq = {Hq}, Hk = {Hk}, Hv = {Hv}",
        )
    for name, x in (("k", k), ("v", v)):
        _check_device(name, x, q.device)
    return B, T, Hq, Hk, Hv, K, V


# --- the rule and its gates g, gk, beta, erase, write ------------------------------

def _check_gates(rule, *, g, gk, beta, erase, write, B, T, Hv, K, V, device) -> None:
    """The rule, the gates it needs (and none it has no use for), each gate's shape, dtype and device."""
    if rule not in RULES:
        raise ContractError("rule", " | ".join(RULES), repr(rule))
    _check_presence(rule, g=g, gk=gk, beta=beta, erase=erase, write=write)
    for name, x, shape in (("g", g, (B, T, Hv)), ("gk", gk, (B, T, Hv, K)), ("beta", beta, (B, T, Hv)),
                           ("erase", erase, (B, T, Hv, K)), ("write", write, (B, T, Hv, V))):
        if x is not None:
            _check_tensor(name, x, shape=shape, dtypes=INPUT_DTYPES, dtype_names=_DTYPE_NAMES, device=device)


def _check_presence(rule, *, g, gk, beta, erase, write):
    has_decay = g is not None or gk is not None
    if rule in GATED_RULES and not has_decay:
        raise ContractError("g", f"g and/or gk for rule {rule!r}", "neither")
    if rule not in GATED_RULES:
        for name, x in (("g", g), ("gk", gk)):
            if x is not None:
                raise ContractError(name, f"None for rule {rule!r} (no decay)", "a tensor")
    if rule in DELTA_RULES:
        if beta is not None and (erase is not None or write is not None):
            raise ContractError("beta", "None when erase / write are given", "a tensor")
        if beta is None and (erase is None) != (write is None):
            missing = "write" if write is None else "erase"
            raise ContractError(missing, "erase and write together", f"{missing} = None")
        if beta is None and erase is None:
            raise ContractError("beta", f"beta, or erase and write, for rule {rule!r}", "none")
    else:
        for name, x in (("beta", beta), ("erase", erase), ("write", write)):
            if x is not None:
                raise ContractError(name, f"None for rule {rule!r} (no retrieval)", "a tensor")


# --- the scalars ------------------------------------------------------------------

def _check_scale(scale, K: int):
    """scale, defaulting to 1 / sqrt(K): finite in float32, the kernels' precision."""
    if scale is None:
        scale = K ** -0.5
    if not finite_float32(scale):
        raise ContractError("scale", f"a real number finite in float32 (|scale| <= {_FLOAT32_MAX:.8g}) or None",
                            repr(scale))
    return scale


def _check_flags(rule, *, qk_l2norm, l2norm_eps, beta_sigmoid) -> None:
    """qk_l2norm and beta_sigmoid are bools, l2norm_eps a finite number >= 0; beta_sigmoid needs a beta."""
    for name, flag in (("qk_l2norm", qk_l2norm), ("beta_sigmoid", beta_sigmoid)):
        if not isinstance(flag, bool):
            raise ContractError(name, "a bool", repr(flag))
    if not finite_float32(l2norm_eps) or l2norm_eps < 0:
        raise ContractError("l2norm_eps", f"a number >= 0 finite in float32 (<= {_FLOAT32_MAX:.8g})",
                            repr(l2norm_eps))
    if beta_sigmoid and rule not in DELTA_RULES:
        raise ContractError("beta_sigmoid", f"False for rule {rule!r} (no beta)", True)


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ContractError("chunk_size", "an int >= 1", repr(chunk_size))


# --- the state initial_state, state_layout ------------------------------------------

def _check_state(initial_state, state_layout, *, slab: bool, device) -> int | None:
    """state_layout, and initial_state as a tensor, a device slab (only with slab rows, in the
    call's layout) or None (not with slab rows); its shape waits for the batch layout
    (`_check_state_shape`). Returns the slab's row count S, or None without slab rows."""
    if state_layout not in LAYOUTS:
        raise ContractError("state_layout", " | ".join(repr(x) for x in LAYOUTS), repr(state_layout))
    if isinstance(initial_state, DeviceSlab):
        if not slab:
            raise ContractError("state_indices", "slab rows when initial_state is a device slab", None)
        if initial_state.layout != state_layout:
            raise ContractError("state_layout", f"the device slab's layout {initial_state.layout!r}",
                                repr(state_layout))
    elif initial_state is not None:
        _check_tensor("initial_state", initial_state, rank=4, dtypes=STATE_DTYPES,
                      dtype_names=_DTYPE_NAMES, device=device)
    if slab and initial_state is None:
        raise ContractError("initial_state", "a state slab when state_indices is given", None)
    return initial_state.shape[0] if slab else None


def _check_state_shape(initial_state, state_layout, *, slab: bool, N: int, Hv: int, K: int, V: int) -> None:
    """initial_state [N, Hv, K, V] ("kv") or [N, Hv, V, K] ("vk"); a slab has any row count S."""
    state_tail = (Hv, K, V) if state_layout == "kv" else (Hv, V, K)
    if tuple(initial_state.shape[1:]) != state_tail or (not slab and initial_state.shape[0] != N):
        rows = "S" if slab else str(N)
        letters = "[{}, Hv, K, V]" if state_layout == "kv" else "[{}, Hv, V, K]"
        expected = letters.format(rows) + " = " + str([rows, *state_tail])
        raise ContractError("initial_state", expected, tuple(initial_state.shape))


# --- the batch layout cu_seqlens, seq_lens, state_indices, num_accepted_tokens, plan ---

def _check_batch(plan, *, B, T, device, cu_seqlens, seq_lens, state_indices, num_accepted_tokens,
                 num_slots) -> BatchPlan:
    """The call's `BatchPlan`: built from the batch tensors, or a given plan (then without them)
    checked against the call."""
    if plan is None:
        return _batch.build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                            state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                            num_slots=num_slots)
    if not isinstance(plan, BatchPlan):
        raise ContractError("plan", "a deltarule.BatchPlan (deltarule.plan_batch) or None",
                            type(plan).__name__)
    for name, x in (("cu_seqlens", cu_seqlens), ("seq_lens", seq_lens), ("state_indices", state_indices),
                    ("num_accepted_tokens", num_accepted_tokens)):
        if x is not None:
            raise ContractError(name, "None when a plan is given (the plan holds the batch layout)",
                                "a tensor")
    plan.check_call(B=B, T=T, device=device, num_slots=num_slots)
    return plan


# --- the fused gate A_log, dt_bias ------------------------------------------------

def _check_raw_gate(A_log, dt_bias, *, g, gk, Hv, K, device):
    if A_log is None and dt_bias is None:
        return
    if A_log is None or dt_bias is None:
        missing = "dt_bias" if dt_bias is None else "A_log"
        raise ContractError(missing, "A_log and dt_bias together", f"{missing} = None")
    if g is not None and gk is not None:
        raise ContractError("A_log", "None when both g and gk are given (ambiguous raw gate)", "a tensor")
    if g is None and gk is None:
        raise ContractError("A_log", "None without a decay gate g or gk", "a tensor")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    _check_tensor("A_log", A_log, shape=(Hv,), dtypes=floats, dtype_names=_DTYPE_NAMES, device=device)
    bias_shape = (Hv,) if g is not None else (Hv, K)
    _check_tensor("dt_bias", dt_bias, shape=bias_shape, dtypes=floats, dtype_names=_DTYPE_NAMES, device=device)


# --- memory shared with a written tensor, autograd, capture, the decay's sign -------

def _read_inputs(q, k, v, g, gk, beta, erase, write, A_log, dt_bias) -> tuple:
    """The inputs by name that a written tensor (a state slab, a capture) must share no memory with."""
    return (("q", q), ("k", k), ("v", v), ("g", g), ("gk", gk), ("beta", beta), ("erase", erase),
            ("write", write), ("A_log", A_log), ("dt_bias", dt_bias))


def _needs_grad(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state) -> bool:
    """An input requires grad (unrolled: a decode step asks per layer)."""
    return (q.requires_grad or k.requires_grad or v.requires_grad or (g is not None and g.requires_grad)
            or (gk is not None and gk.requires_grad) or (beta is not None and beta.requires_grad)
            or (erase is not None and erase.requires_grad) or (write is not None and write.requires_grad)
            or (A_log is not None and A_log.requires_grad) or (dt_bias is not None and dt_bias.requires_grad)
            or (initial_state is not None and initial_state.requires_grad))


def _check_differentiable(plan: BatchPlan) -> None:
    """A call whose inputs require grad must be one autograd can follow."""
    if plan.in_place:
        raise ContractError("state_indices", "None when an input requires grad (a state slab is "
                            "updated in place, which autograd cannot differentiate)", "slab rows")
    if plan.overlapping():
        raise ContractError("cu_seqlens", "sequences that do not overlap when an input requires grad",
                            "overlapping (clamped) sequences")


def _check_capture(capture, plan: BatchPlan, *, requires_grad, N, Dw, step, device, inputs) -> BatchPlan:
    """A capture buffer [N, C * (Dw + Hk*K + Hv*V)], C >= 1: float32, contiguous (the kernels
    address it flat), sharing memory with no input. Returns the plan the backends run: with a
    slab, one that reads the rows and stores nothing (`BatchPlan.verify`)."""
    width = Dw + step
    _check_tensor("capture", capture, rank=2, dtypes=(torch.float32,), dtype_names="float32", device=device)
    if capture.shape[0] != N or capture.shape[1] < width or capture.shape[1] % width:
        raise ContractError("capture", f"[N, C * (Dw + Hk*K + Hv*V)] = [{N}, C * {width}] with C >= 1",
                            list(capture.shape))
    if not capture.is_contiguous():
        raise ContractError("capture", "a contiguous tensor", f"strides {capture.stride()}")
    if requires_grad:
        raise ContractError("capture", "None when an input requires grad (the captured factors are not "
                            "differentiated)", "a tensor")
    if plan.speculative:
        raise ContractError("capture", "None with 2-D state_indices (the capture replaces per-token rows)",
                            "a tensor")
    aliasing.check_written("capture", capture, inputs)
    return plan.verify() if plan.in_place else plan


def _check_log_decay(*, g, gk) -> None:
    """g and gk are natural-log decays: a positive one (a state that grows, e.g. a decay of 0.9
    passed where log(0.9) was meant) overflows to inf over a long sequence. Reads the values
    (one device sync off the CPU); NaN is not positive (it propagates, as in the reference)."""
    for name, x in (("g", g), ("gk", gk)):
        if x is not None and x.numel() and bool((x > 0).any()):
            flat = int((x.reshape(-1) > 0).nonzero()[0])
            raise positive_log_decay(name, x, flat)


# --- shared checks ------------------------------------------------------------------

def finite_float32(x) -> bool:
    """A real number that float32, the precision of every kernel, holds as a finite value
    (rounded: 1e39 is finite in float64 but inf in float32)."""
    if not _finite_real(x):
        return False
    try:
        return math.isfinite(_FLOAT32.unpack(_FLOAT32.pack(x))[0])     # packing rounds to float32
    except OverflowError:                          # older Pythons raise instead of rounding to inf
        return False


def _finite_real(x) -> bool:
    if type(x) is float:                            # the common case, before the slow ABC check
        return math.isfinite(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:                          # an int beyond float range
        return False


def _check_tensor(name, x, *, rank=None, shape=None, dtypes, dtype_names, device=None):
    if not isinstance(x, torch.Tensor):
        raise ContractError(name, "a torch.Tensor", type(x).__name__)
    if shape is not None and x.shape != shape:
        raise ContractError(name, f"shape {list(shape)}", list(x.shape))
    if rank is not None and x.dim() != rank:
        raise ContractError(name, f"a rank-{rank} tensor", f"shape {list(x.shape)}")
    if x.dtype not in dtypes:
        raise ContractError(name, f"dtype {dtype_names}", x.dtype)
    if device is not None:
        _check_device(name, x, device)


def _check_device(name, x, device):
    if x.device != device:
        raise ContractError(name, f"device {device} (q's)", x.device)


arguments.check_signature(validate, without=("backend",), internal=True)

"""The public operator `linear_attention`: validation, defaults, dispatch."""

from __future__ import annotations

import collections
import math
import numbers
import struct

import torch

from . import aliasing
from . import backends as _backends
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
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_FLOAT32_MAX = torch.finfo(torch.float32).max


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    rule: str = "gated_delta",
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    erase: torch.Tensor | None = None,
    write: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    state_layout: str = "kv",
    cu_seqlens: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    plan: BatchPlan | None = None,
    qk_l2norm: bool = False,
    l2norm_eps: float = 1e-6,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The generalized gated delta rule, one formula for the whole family.

    Per sequence and state head, with state S [K, V] (float32, K-major)::

        S' = diag(exp(gk_t + g_t)) S_{t-1}
        S_t = S' + k_t (w_t * v_t - S'^T (b_t * k_t))^T      # b = erase, w = write
        o_t = scale * S_t^T q_t

    Args:
        q: [B, T, Hq, K] float32 / float16 / bfloat16 queries.
        k: [B, T, Hk, K] keys, q's dtype. L2-normalised keys (or
            `qk_l2norm=True`) keep the delta rules well conditioned.
        v: [B, T, Hv, V] values, q's dtype. Hv is the number of state heads;
            Hv must be a multiple of Hk (value head h reads key head
            h // (Hv // Hk)); queries either match the keys (Hq == Hk, "GVA")
            or are a multiple of Hv == Hk (query head j reads state head
            j // (Hq // Hv), "GQA").
        rule: "linear" | "gated" | "delta" | "gated_delta" (default).
        g: [B, T, Hv] scalar log-space decay (natural log, <= 0: log(0.9), not
            0.9; -inf resets the state), float32 (preferred), float16 or
            bfloat16; the gates are used in float32. A positive value is
            refused (the values are read: one device sync off the CPU).
            Present (alone or with `gk`) exactly for "gated" / "gated_delta".
        gk: [B, T, Hv, K] per-key log-space decay (KDA), <= 0 like `g`. May
            come with `g`.
        beta: [B, T, Hv] erase = write rate. Exactly one of `beta` or the pair
            `erase` / `write` for "delta" / "gated_delta"; none otherwise.
        erase: [B, T, Hv, K] channel-wise erase gate (Gated DeltaNet-2).
        write: [B, T, Hv, V] channel-wise write gate (Gated DeltaNet-2).
        scale: output scale, default K ** -0.5; must be finite in float32.
        initial_state: [N, Hv, K, V] ("kv") or [N, Hv, V, K] ("vk"), float32,
            bfloat16 or float16 (storage only: the state is float32 between a
            sequence's tokens, and stores round to nearest even); default
            zeros. With `state_indices` it is a slab [S, Hv, ...] updated IN
            PLACE and returned: its elements may not share memory with each
            other or with any input (docs/design.md, "Aliasing"); a device-resident slab
            (`deltarule.kernels.wgsl.WgslStateSlab`) runs on its own backend.
        state_layout: "kv" (default) or "vk", the layout of `initial_state`
            and of the returned state.
        cu_seqlens: [N + 1] int32 / int64 packed varlen offsets; needs B == 1.
            Offsets are clamped to [0, T]; a decreasing or equal pair gives an
            empty sequence whose state is copied through. Tokens outside every
            sequence get a zero output; where clamped spans overlap, the later
            sequence writes the output.
        seq_lens: [B] int ragged lengths in [0, T]; outputs past a row's
            length are zero. Excludes `cu_seqlens`.
        state_indices: [N] int slab rows, distinct; negative = padding (zero
            output, no slab row touched). Needs `initial_state`. Or [N, L]
            (speculative decoding): token t of sequence n (t < its length <=
            L) stores its post-update state into row state_indices[n, t];
            the initial state is read from row state_indices[n, a - 1], a =
            num_accepted_tokens[n] (column 0 without it); a negative read row
            makes the sequence padding, other negative entries are never
            written; the rows live sequences write are distinct. Every read
            happens before any write, so a row may be read and rewritten.
        num_accepted_tokens: [N] int in [1, L] (may exceed the sequence's
            length: vLLM's request without drafts after accepted ones; a row
            read past the sequence's tokens may not be one another live
            sequence writes); only with 2-D `state_indices`.
        plan: a `deltarule.BatchPlan` from `deltarule.plan_batch`, instead
            of cu_seqlens / seq_lens / state_indices / num_accepted_tokens:
            validated once, reusable by every call of that batch layout
            (every layer of a decode step).
        qk_l2norm: L2-normalise q and k per head in float32:
            x * rsqrt(sum(x^2) + l2norm_eps).
        l2norm_eps: default 1e-6; >= 0 and finite in float32.
        A_log: [Hv] float32 / float16 / bfloat16; with `dt_bias`, `g` (or `gk`) is the raw gate
            projection and the decay is -exp(A_log) * softplus(g + dt_bias),
            formed in float32.
        dt_bias: [Hv] beside `g`, or [Hv, K] beside `gk`.
        beta_sigmoid: apply a sigmoid to beta / erase / write in float32.
        chunk_size: scheduling hint >= 1; never changes the result beyond
            rounding.
        backend: "auto" (default) or a name from `deltarule.backends()`.

    Returns:
        (o, state): o [B, T, max(Hq, Hv), V] in v's dtype; state in
        `state_layout` and initial_state's dtype (float32 without one),
        [N, Hv, K, V] (or the slab itself with `state_indices`),
        N = len(cu_seqlens) - 1 with varlen, else B.

    Raises:
        ContractError: any invalid argument, before any work; with inputs that
            require grad, also a slab (`state_indices`) or overlapping
            `cu_seqlens` sequences (autograd cannot follow them); a slab that
            overlaps itself or an input; a positive log decay.
        Unsupported: the named backend declines this valid call (e.g. it has no
            backward and an input requires grad).

    Example:
        >>> import torch, deltarule
        >>> B, T, H, K, V = 1, 5, 2, 8, 8
        >>> q, k, v = (torch.randn(B, T, H, d) for d in (K, K, V))
        >>> k = torch.nn.functional.normalize(k, dim=-1)
        >>> g = -torch.rand(B, T, H)
        >>> beta = torch.rand(B, T, H)
        >>> o, state = deltarule.linear_attention(q, k, v, g=g, beta=beta)
        >>> tuple(o.shape), tuple(state.shape)
        ((1, 5, 2, 8), (1, 2, 8, 8))

    Gradients (docs/design.md, "Gradients"): differentiable with respect to q,
    k, v, g, gk, beta, erase, write, A_log, dt_bias and a non-slab
    initial_state, through each backend's own reverse kernel::

        >>> _ = q.requires_grad_(True)
        >>> o, state = deltarule.linear_attention(q, k, v, g=g, beta=beta)
        >>> (o.square().sum() + state.sum()).backward()
        >>> tuple(q.grad.shape)
        (1, 5, 2, 8)

    Speculative decoding (docs/design.md, "Speculative decoding"): verify 3
    draft tokens per request, keeping every token's state in its own row::

        >>> slab = torch.zeros(8, H, K, V)
        >>> q, k, v = (torch.randn(2, 3, H, d) for d in (K, K, V))     # no grad: a slab is updated in place
        >>> rows = torch.tensor([[0, 1, 2], [4, 5, 6]])      # request n's 3 rows
        >>> o, slab = deltarule.linear_attention(
        ...     q, k, v, g=-torch.rand(2, 3, H), beta=torch.rand(2, 3, H),
        ...     initial_state=slab, state_indices=rows)
        >>> bool(slab[3].eq(0).all()), bool(slab[6].ne(0).any())
        (True, True)
    """
    return _call(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, cu_seqlens,
                 seq_lens, state_indices, num_accepted_tokens, plan, qk_l2norm, l2norm_eps, A_log, dt_bias,
                 beta_sigmoid, chunk_size, backend, False)


def call(q, k, v, *, rule="gated_delta", g=None, gk=None, beta=None, erase=None, write=None, scale=None,
         initial_state=None, state_layout="kv", cu_seqlens=None, seq_lens=None, state_indices=None,
         num_accepted_tokens=None, plan=None, qk_l2norm=False, l2norm_eps=1e-6, A_log=None, dt_bias=None,
         beta_sigmoid=False, chunk_size=64, backend="auto", accept_growth=False):
    """`linear_attention` for the contract adapters: the same arguments, plus `accept_growth`
    (see `validate`): the adapters of runtimes that take positive log decays pass True."""
    return _call(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, cu_seqlens,
                 seq_lens, state_indices, num_accepted_tokens, plan, qk_l2norm, l2norm_eps, A_log, dt_bias,
                 beta_sigmoid, chunk_size, backend, accept_growth)


def _call(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, cu_seqlens, seq_lens,
          state_indices, num_accepted_tokens, plan, qk_l2norm, l2norm_eps, A_log, dt_bias, beta_sigmoid,
          chunk_size, backend, accept_growth):
    """Validate and run; a call whose batch layout and signature were validated before (its
    plan, given or found in `_PLANS`, keeps the launch: `_launch`) runs its launch. Traced by
    torch.compile, the call is one of deltarule's custom ops (`deltarule.library`)."""
    if _is_compiling():
        from . import library

        return library.call(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout,
                            cu_seqlens, seq_lens, state_indices, num_accepted_tokens, plan, qk_l2norm,
                            l2norm_eps, A_log, dt_bias, beta_sigmoid, chunk_size, backend, accept_growth)
    if plan is None:
        plan = _known_plan(q, initial_state, cu_seqlens, seq_lens, state_indices, num_accepted_tokens)
        if plan is not None:
            cu_seqlens = seq_lens = state_indices = num_accepted_tokens = None
    if plan is not None and cu_seqlens is None and seq_lens is None and state_indices is None \
            and num_accepted_tokens is None and (backend == "auto" or backend == "cpu"):
        # the launch of this call signature, validated when first seen (`_launch`). Only all-CPU
        # signatures keep a launch (is_cpu stands for the device); inputs that need grad make
        # their own signature (which keeps none). Scalars are keyed with their types: True == 1 and
        # 0 == False (equal, same hash) but validation refuses a bool scale, chunk_size or
        # l2norm_eps and an int flag, so a kept launch of one may not answer for the other
        try:
            key = (q.shape, q.is_contiguous(), q.dtype, q.is_cpu, k.shape, k.is_contiguous(), k.dtype, k.is_cpu,
                   v.shape, v.is_contiguous(), v.dtype, v.is_cpu,
                   None if g is None else (g.shape, g.is_contiguous(), g.dtype, g.is_cpu),
                   None if gk is None else (gk.shape, gk.is_contiguous(), gk.dtype, gk.is_cpu),
                   None if beta is None else (beta.shape, beta.is_contiguous(), beta.dtype, beta.is_cpu),
                   None if erase is None else (erase.shape, erase.is_contiguous(), erase.dtype, erase.is_cpu),
                   None if write is None else (write.shape, write.is_contiguous(), write.dtype, write.is_cpu),
                   None if A_log is None else (A_log.shape, A_log.is_contiguous(), A_log.dtype, A_log.is_cpu),
                   None if dt_bias is None else (dt_bias.shape, dt_bias.is_contiguous(), dt_bias.dtype,
                                                 dt_bias.is_cpu),
                   None if initial_state is None else (initial_state.shape, initial_state.stride(),
                                                       initial_state.dtype, initial_state.is_cpu),
                   _is_grad_enabled() and _needs_grad(q, k, v, g, gk, beta, erase, write, A_log, dt_bias,
                                                      initial_state),
                   rule, scale, state_layout, qk_l2norm, l2norm_eps, beta_sigmoid, chunk_size, backend, accept_growth,
                   type(scale), type(qk_l2norm), type(l2norm_eps), type(beta_sigmoid), type(chunk_size))
            launch = plan._cache[key]
        except KeyError:
            launch = plan.cached(key, lambda: _launch(
                plan, q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, qk_l2norm,
                l2norm_eps, A_log, dt_bias, beta_sigmoid, chunk_size, backend, accept_growth))
        except (AttributeError, TypeError):          # not tensors, unhashable scalars: the full path says what
            launch = None
        if launch is not None:
            return launch(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state)
    problem = validate(
        q, k, v, rule=rule, g=g, gk=gk, beta=beta, erase=erase, write=write,
        scale=scale, initial_state=initial_state, state_layout=state_layout,
        cu_seqlens=cu_seqlens, seq_lens=seq_lens, state_indices=state_indices,
        num_accepted_tokens=num_accepted_tokens, plan=plan, qk_l2norm=qk_l2norm, l2norm_eps=l2norm_eps,
        A_log=A_log, dt_bias=dt_bias, beta_sigmoid=beta_sigmoid, chunk_size=chunk_size,
        accept_growth=accept_growth,
    )
    return _backends.dispatch(problem, backend)


# Plans of calls that brought their index tensors (or none), by the indices' values: a decode
# step's layers pass the same ones, so all but the first find the plan here (reading the
# indices to the host is the only per-call cost of the layout). Least recently used first.
_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLANS_KEPT = 64


def _known_plan(q, initial_state, cu_seqlens, seq_lens, state_indices, num_accepted_tokens) -> BatchPlan | None:
    """The plan of a call without `plan=`, from `_PLANS` or built (and kept); None where the call
    is not one a plan can take (the full validation then says why)."""
    try:
        B, T, _, _ = q.shape
        if cu_seqlens is None and seq_lens is None and state_indices is None and num_accepted_tokens is None:
            return _batch.dense(B, T, q.device)
        slots = None if state_indices is None else initial_state.shape[0]
        device = q.device
        key = (B, T, device, slots, _values(cu_seqlens, device), _values(seq_lens, device),
               _values(state_indices, device), _values(num_accepted_tokens, device))
    except (AttributeError, TypeError, ValueError):
        return None
    plan = _PLANS.get(key)
    if plan is None:
        try:
            plan = _batch.build(B, T, q.device, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                                state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                                num_slots=slots)
        except ContractError:
            return None                              # the full validation raises it, in its order
        _PLANS[key] = plan
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _values(x, device):
    """An index tensor's part of a plan key: its dtype and values (read to the host); one on
    another device than q's is not read (ValueError: the full validation refuses it)."""
    if x is None:
        return None
    if x.device != device or x.dim() not in (1, 2):
        raise ValueError(x.device)
    values = x.tolist()
    return x.dtype, tuple(map(tuple, values)) if x.dim() == 2 else tuple(values)


def _launch(plan, q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, qk_l2norm,
            l2norm_eps, A_log, dt_bias, beta_sigmoid, chunk_size, backend, accept_growth):
    """The launch a call signature keeps (`backends.launch`), or None (the call takes the full path
    every time: its backend keeps none, or an input needs grad). Validates the call: a signature
    is everything `validate` checks that does not depend on the tensors' values or addresses
    (shapes, strides, dtypes, devices, which inputs are given, whether they need grad, and
    every scalar); the launch checks what does (the sign of the log decays, a slab's overlap
    with the inputs) on every call."""
    problem = validate(q, k, v, rule=rule, g=g, gk=gk, beta=beta, erase=erase, write=write, scale=scale,
                       initial_state=initial_state, state_layout=state_layout, plan=plan, qk_l2norm=qk_l2norm,
                       l2norm_eps=l2norm_eps, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=beta_sigmoid,
                       chunk_size=chunk_size, accept_growth=accept_growth)
    return _backends.launch(problem, backend)


def validate(
    q, k, v, *, rule="gated_delta", g=None, gk=None, beta=None, erase=None, write=None,
    scale=None, initial_state=None, state_layout="kv", cu_seqlens=None, seq_lens=None,
    state_indices=None, num_accepted_tokens=None, plan=None, qk_l2norm=False, l2norm_eps=1e-6, A_log=None,
    dt_bias=None, beta_sigmoid=False, chunk_size=64, accept_growth=False,
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
    device = q.device
    for name, x in (("k", k), ("v", v)):
        _check_device(name, x, device)

    if rule not in RULES:
        raise ContractError("rule", " | ".join(RULES), repr(rule))
    _check_presence(rule, g=g, gk=gk, beta=beta, erase=erase, write=write)
    for name, x, shape in (("g", g, (B, T, Hv)), ("gk", gk, (B, T, Hv, K)), ("beta", beta, (B, T, Hv)),
                           ("erase", erase, (B, T, Hv, K)), ("write", write, (B, T, Hv, V))):
        if x is not None:
            _check_tensor(name, x, shape=shape, dtypes=INPUT_DTYPES, dtype_names=_DTYPE_NAMES, device=device)

    if scale is None:
        scale = K ** -0.5
    if not finite_float32(scale):
        raise ContractError("scale", f"a real number finite in float32 (|scale| <= {_FLOAT32_MAX:.8g}) or None",
                            repr(scale))

    if state_layout not in LAYOUTS:
        raise ContractError("state_layout", " | ".join(repr(x) for x in LAYOUTS), repr(state_layout))
    slab = state_indices is not None or (isinstance(plan, BatchPlan) and plan.in_place)
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
    num_slots = initial_state.shape[0] if slab else None
    if plan is None:
        plan = _batch.build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                            state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                            num_slots=num_slots)
    else:
        if not isinstance(plan, BatchPlan):
            raise ContractError("plan", "a deltarule.BatchPlan (deltarule.plan_batch) or None",
                                type(plan).__name__)
        for name, x in (("cu_seqlens", cu_seqlens), ("seq_lens", seq_lens), ("state_indices", state_indices),
                        ("num_accepted_tokens", num_accepted_tokens)):
            if x is not None:
                raise ContractError(name, "None when a plan is given (the plan holds the batch layout)",
                                    "a tensor")
        plan.check_call(B=B, T=T, device=device, num_slots=num_slots)
    N = plan.N

    if initial_state is not None:
        state_tail = (Hv, K, V) if state_layout == "kv" else (Hv, V, K)
        if tuple(initial_state.shape[1:]) != state_tail or (not slab and initial_state.shape[0] != N):
            rows = "S" if slab else str(N)
            letters = "[{}, Hv, K, V]" if state_layout == "kv" else "[{}, Hv, V, K]"
            expected = letters.format(rows) + " = " + str([rows, *state_tail])
            raise ContractError("initial_state", expected, tuple(initial_state.shape))

    for name, flag in (("qk_l2norm", qk_l2norm), ("beta_sigmoid", beta_sigmoid)):
        if not isinstance(flag, bool):
            raise ContractError(name, "a bool", repr(flag))
    if not finite_float32(l2norm_eps) or l2norm_eps < 0:
        raise ContractError("l2norm_eps", f"a number >= 0 finite in float32 (<= {_FLOAT32_MAX:.8g})",
                            repr(l2norm_eps))
    if beta_sigmoid and rule not in DELTA_RULES:
        raise ContractError("beta_sigmoid", f"False for rule {rule!r} (no beta)", True)
    _check_raw_gate(A_log, dt_bias, g=g, gk=gk, Hv=Hv, K=K, device=device)

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ContractError("chunk_size", "an int >= 1", repr(chunk_size))
    if slab and isinstance(initial_state, torch.Tensor):
        aliasing.check_written("initial_state", initial_state, (
            ("q", q), ("k", k), ("v", v), ("g", g), ("gk", gk), ("beta", beta), ("erase", erase),
            ("write", write), ("A_log", A_log), ("dt_bias", dt_bias)))
    if not accept_growth and A_log is None:
        _check_log_decay(g=g, gk=gk)

    requires_grad = torch.is_grad_enabled() and _needs_grad(
        *differentiable_inputs(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state))
    if requires_grad:
        _check_differentiable(plan)

    return Problem(
        q=q, k=k, v=v, rule=rule, g=g, gk=gk, beta=beta, erase=erase, write=write,
        scale=float(scale), initial_state=initial_state, state_layout=state_layout,
        plan=plan, qk_l2norm=qk_l2norm, l2norm_eps=float(l2norm_eps), A_log=A_log, dt_bias=dt_bias,
        beta_sigmoid=beta_sigmoid, chunk_size=int(chunk_size),
        B=B, T=T, Hq=Hq, Hk=Hk, Hv=Hv, K=K, V=V, G=max(Hq // Hv, 1), Ho=max(Hq, Hv),
        state_dtype=initial_state.dtype if isinstance(initial_state, torch.Tensor) else torch.float32,
        device=device, requires_grad=requires_grad, accept_growth=bool(accept_growth),
    )


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


def _check_log_decay(*, g, gk) -> None:
    """g and gk are natural-log decays: a positive one (a state that grows, e.g. a decay of 0.9
    passed where log(0.9) was meant) overflows to inf over a long sequence. Reads the values
    (one device sync off the CPU); NaN is not positive (it propagates, as in the reference)."""
    for name, x in (("g", g), ("gk", gk)):
        if x is not None and x.numel() and bool((x > 0).any()):
            flat = int((x.reshape(-1) > 0).nonzero()[0])
            raise positive_log_decay(name, x, flat)


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

"""flash-linear-attention's Python API, as drop-in functions on `linear_attention`.

Code written against ``fla.ops.gated_delta_rule`` / ``fla.ops.kda`` /
``fla.ops.gdn2`` runs unchanged (on CPU too) by swapping the import::

    # from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from deltarule.contracts.fla import chunk_gated_delta_rule

Every function has the signature of its fla namesake (fla-core 0.6.0:
argument names, order and defaults) and is a thin mapping onto
`deltarule.linear_attention`; no recurrence is implemented here. What fla
computes is reproduced, including its defaults:

- ``scale=None`` -> ``K ** -0.5``; ``output_final_state=False`` returns
  ``(o, None)``; the final state is float32, ``[N, HV, K, V]``, or
  ``[N, HV, V, K]`` with ``state_v_first=True`` (deprecated spelling
  ``transpose_state_layout=`` is accepted with a DeprecationWarning).
- ``o`` has q's dtype for ``chunk_*`` and v's dtype for ``fused_recurrent_*``.
- ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x^2) + 1e-6)`` in float32.
- ``use_beta_sigmoid_in_kernel``: ``sigmoid(beta)``, or ``2 * sigmoid(beta)``
  with ``allow_neg_eigval=True``, in float32.
- ``use_gate_in_kernel``: ``-exp(A_log) * softplus(g + dt_bias)`` in float32
  (``dt_bias`` optional, ``[HV]`` for GDN, ``[HV * K]`` or ``[HV, K]`` for
  KDA / GDN-2); for KDA / GDN-2 with ``lower_bound`` set,
  ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be
  None: ``lower_bound * sigmoid(g + dt_bias)``). Without ``use_gate_in_kernel``
  fla ignores ``A_log`` / ``dt_bias`` / ``lower_bound``, and so does this module.

``return_intermediate_states=True`` (``chunk_kda``, ``chunk_gdn2``; inside
``torch.inference_mode()``, as fla requires) also returns ``h``, the state at
the start of every chunk, as fla does.

Arguments deltarule cannot honour raise `deltarule.ContractError` (a
`ValueError`, as fla's own argument errors are) with the reason: ``gv``,
per-value ``beta`` ``[B, T, HV, V]``, ``cp_context``, ``head_first``, and any
keyword fla does not read. Pure scheduling hints (``chunk_indices``, ``cu_seqlens_cpu``,
``disable_recompute``, ``safe_gate``, ``use_graph``) are accepted: they do not
change fla's result. See docs/contracts-fla.md for the full table.
"""

from __future__ import annotations

import functools
import numbers
import warnings

import torch

from ..api import call as _call
from ..errors import ContractError
from ..gate import bounded_gate, check_lower_bound
from ..problem import INPUT_DTYPES
from ..validation import validate
from ._checks import check_floating

__all__ = [
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "chunk_gdn", "fused_recurrent_gdn",
    "chunk_kda", "fused_recurrent_kda",
    "chunk_gdn2", "fused_recurrent_gdn2",
]

# fla's in-kernel L2 norm: x / sqrt(sum(x^2) + 1e-6) (l2norm_fwd and the fused kernels).
FLA_L2NORM_EPS = 1e-6


# ---------------------------------------------------------------------------
# argument mapping helpers
# ---------------------------------------------------------------------------

def _kwargs(fn: str, kwargs: dict, state_v_first: bool, known: tuple[str, ...] = ()) -> tuple[dict, bool]:
    """Split fla's **kwargs: the deprecated layout alias, the known keys, the rest refused."""
    kwargs = dict(kwargs)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ContractError(
                "transpose_state_layout", "not together with state_v_first (its deprecated alias)", "both given")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    if "head_first" in kwargs:
        raise ContractError("head_first", "absent: removed from fla, inputs are [B, T, H, ...]",
                            repr(kwargs["head_first"]))
    extra = sorted(set(kwargs) - set(known))
    if extra:
        raise ContractError(
            ", ".join(extra),
            f"only the keywords fla's {fn} reads" + (f" ({', '.join(known)})" if known else ""),
            "unknown keyword(s) (fla would silently ignore them)",
        )
    return kwargs, bool(state_v_first)


def _refuse_unsupported(*, cp_context=None):
    if cp_context is not None:
        raise ContractError("cp_context", "None: context parallelism across devices is not supported",
                            type(cp_context).__name__)


def _check_intermediate_states(return_intermediate_states, disable_recompute) -> bool:
    """fla's two rules for ``return_intermediate_states=True`` (asserts in fla, ContractError here)."""
    if not return_intermediate_states:
        return False
    if not torch.is_inference_mode_enabled():
        raise ContractError("return_intermediate_states",
                            "True only inside torch.inference_mode() (fla's rule: the states bypass autograd)",
                            "autograd enabled")
    if disable_recompute:
        raise ContractError("disable_recompute", "False with return_intermediate_states=True (fla's rule)", True)
    return True


# fla-core 0.6.0's ValueError messages for a chunk_size its chunk kernel does not take, word for
# word: fla's own tests match them (tests/ops/test_kda.py and test_gdn2.py,
# pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64") and
# r"`chunk_size` must be 64 for GDN-2"), and those tests run against these drop-ins.
_CHUNK_SIZE_MESSAGES = {
    "chunk_gated_delta_rule": "`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {}.",
    "chunk_kda": "`chunk_size` must be either 32 or 64 for KDA, got {}.",
    "chunk_gdn2": "`chunk_size` must be 64 for GDN-2, got {}.",
}


def _check_chunk_size(fn: str, chunk_size, allowed: tuple[int, ...]) -> int:
    if isinstance(chunk_size, bool) or not _one_of(chunk_size, allowed):
        error = ContractError("chunk_size", f"one of {allowed} for fla's {fn}", repr(chunk_size))
        # Still a ContractError (a ValueError, as fla raises) with argument / expected / actual,
        # but worded as fla words it: it names the argument, the allowed values and the value.
        error.args = (_CHUNK_SIZE_MESSAGES[fn].format(chunk_size),)
        raise error
    return int(chunk_size)


def _one_of(x, allowed) -> bool:
    """x == one of `allowed`; False where the comparison has no single truth value (an array)."""
    try:
        return x in allowed
    except (TypeError, ValueError, RuntimeError):
        return False


def _check_heads(q, k):
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4 \
            and q.shape[2] != k.shape[2]:
        raise ContractError("k", f"as many heads as q (fla: q.shape[2] == k.shape[2] = {q.shape[2]})",
                            f"k.shape[2] = {k.shape[2]}")


def _check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu):
    if cu_seqlens_cpu is None:
        return
    if cu_seqlens is None:
        raise ContractError("cu_seqlens_cpu", "None unless cu_seqlens is given", "a tensor")
    if not isinstance(cu_seqlens, torch.Tensor):
        return                                    # let linear_attention name the bad cu_seqlens
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.tolist() != cu_seqlens.tolist():
        raise ContractError("cu_seqlens_cpu", "a host copy equal to cu_seqlens", cu_seqlens_cpu)


def _check_graph(use_graph, max_num_seqs, cu_seqlens):
    # CUDA/NPU graph capture is a scheduling matter; only fla's shape rule is kept.
    if not use_graph or max_num_seqs is None:
        return
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, numbers.Integral) or max_num_seqs < 0:
        raise ContractError("max_num_seqs", "an int >= 0 or None (the sequences a captured graph holds)",
                            repr(max_num_seqs))
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 \
            and len(cu_seqlens) - 1 != max_num_seqs:     # another cu_seqlens: linear_attention names it
        raise ContractError("cu_seqlens", f"max_num_seqs + 1 = {max_num_seqs + 1} entries with use_graph",
                            f"{len(cu_seqlens)} entries")


def _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    """(beta, beta_sigmoid) for linear_attention."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ContractError("allow_neg_eigval", "False unless use_beta_sigmoid_in_kernel=True", True)
    if allow_neg_eigval and isinstance(beta, torch.Tensor):
        check_floating("beta", beta, device=beta.device)     # before .to(float32) drops a complex part
        return 2.0 * torch.sigmoid(beta.to(torch.float32)), False          # fla: 2 * sigmoid(beta)
    return beta, bool(use_beta_sigmoid_in_kernel)


def _check_headwise_beta(beta, v):
    # only beside a v of its rank 4: a v of another rank is v's error (linear_attention names it)
    if isinstance(beta, torch.Tensor) and isinstance(v, torch.Tensor) and beta.dim() == v.dim() == 4:
        raise ContractError(
            "beta", "[B, T, HV] (a per-value beta [B, T, HV, V] scales the erase term per value "
                    "channel, which the contract's per-key erase gate cannot express)",
            f"shape {list(beta.shape)}")


def _vector_gate(g, A_log, dt_bias, lower_bound, *, use_gate_in_kernel, fn):
    """Per-key gate (KDA / GDN-2): kwargs for linear_attention (gk, A_log, dt_bias)."""
    if not use_gate_in_kernel:
        return {"gk": g}                          # fla ignores A_log / dt_bias / lower_bound here
    if not isinstance(g, torch.Tensor) or g.dim() != 4:
        return {"gk": g}                          # let linear_attention name the bad gate
    HV, K = g.shape[2], g.shape[3]
    if dt_bias is not None:
        if not isinstance(dt_bias, torch.Tensor) or dt_bias.numel() != HV * K:
            raise ContractError("dt_bias", f"[HV * K] = [{HV * K}] (or [HV, K])",
                                getattr(dt_bias, "shape", type(dt_bias).__name__))
        dt_bias = dt_bias.reshape(HV, K)
    if A_log is not None:
        if not isinstance(A_log, torch.Tensor) or A_log.numel() != HV:
            raise ContractError("A_log", f"[HV] = [{HV}]", getattr(A_log, "shape", type(A_log).__name__))
        A_log = A_log.reshape(HV)
    if lower_bound is None:
        if A_log is None:
            raise ContractError("A_log", f"a tensor when use_gate_in_kernel=True and lower_bound is None "
                                         f"(fla's {fn})", None)
        if dt_bias is None:
            dt_bias = torch.zeros(HV, K, dtype=torch.float32, device=g.device)
        return {"gk": g, "A_log": A_log, "dt_bias": dt_bias}   # -exp(A_log) * softplus(g + dt_bias)
    return {"gk": bounded_gate(g, lower_bound, A_log, dt_bias)}   # fla's bounded gate, formed in float32


def _scalar_gate(g, gk, A_log, dt_bias, *, use_gate_in_kernel, fn):
    """Scalar (per-head) gate, plus an optional per-key gk: kwargs for linear_attention."""
    gates = {"g": g, "gk": gk}
    if not use_gate_in_kernel:
        return gates                              # fla ignores A_log / dt_bias here
    if A_log is None:
        raise ContractError("A_log", f"a [HV] tensor when use_gate_in_kernel=True (fla's {fn})", None)
    if not isinstance(g, torch.Tensor) or g.dim() != 3:
        return gates                              # let linear_attention name the bad gate
    HV = g.shape[2]
    if dt_bias is None:
        dt_bias = torch.zeros(HV, dtype=torch.float32, device=g.device)
    if gk is None:
        return {"g": g, "A_log": A_log, "dt_bias": dt_bias}    # -exp(A_log) * softplus(g + dt_bias)
    # With gk too, linear_attention's raw-gate arm would be ambiguous: form g here, in float32 (as fla does).
    check_floating("g", g, device=g.device)       # converted to float32 here: not by linear_attention
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(x, torch.Tensor) or x.numel() != HV:
            raise ContractError(name, f"[HV] = [{HV}]", getattr(x, "shape", type(x).__name__))
        check_floating(name, x, device=g.device)
    g = -torch.exp(A_log.reshape(HV).to(torch.float32)) * torch.nn.functional.softplus(
        g.to(torch.float32) + dt_bias.reshape(HV).to(torch.float32))
    return {"g": g, "gk": gk}


def _check_safe_gate(safe_gate, use_gate_in_kernel, lower_bound):
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ContractError("lower_bound", "a value when safe_gate=True and use_gate_in_kernel=True", None)
        if not -5 <= check_lower_bound(lower_bound) < 0:     # a real number first: ContractError
            raise ContractError("lower_bound", "in the safe range [-5, 0)", lower_bound)


def _run(q, k, v, *, out_dtype_of, scale, initial_state, output_final_state, state_v_first,
         cu_seqlens, qk_l2norm, chunk_size=64, chunk_states=False, **gates):
    """Call linear_attention with fla's conventions; return fla's (o, final_state or None), and
    with `chunk_states` (``return_intermediate_states``) the states at the chunk starts as well,
    h in k's dtype (`_with_chunk_states`)."""
    _check_heads(q, k)
    out_dtype = h_dtype = None
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        out_dtype, h_dtype = (q if out_dtype_of == "q" else v).dtype, k.dtype
        if not (q.dtype == k.dtype == v.dtype) and {q.dtype, k.dtype, v.dtype} <= set(INPUT_DTYPES):
            # fla's kernels read every input in float32: upcasting is exact (other dtypes, e.g.
            # complex or int, go on as they are: linear_attention refuses them, as it would unmixed).
            q, k, v = (x.to(torch.float32) for x in (q, k, v))
    if isinstance(initial_state, torch.Tensor) and initial_state.is_floating_point() \
            and initial_state.dtype != torch.float32:
        initial_state = initial_state.to(torch.float32)   # fla's kernels read h0 in float32
    call = functools.partial(_call, scale=scale, qk_l2norm=bool(qk_l2norm), l2norm_eps=FLA_L2NORM_EPS,
                             chunk_size=chunk_size, state_layout="vk" if state_v_first else "kv", **gates,
                             accept_growth=True)  # fla takes any log decay; linear_attention refuses > 0
    h = None
    if chunk_states and h_dtype is not None:
        o, state, h = _with_chunk_states(call, q, k, v, initial_state=initial_state, state_v_first=state_v_first,
                                         cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    else:
        o, state = call(q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens)
        # fla returns a fresh tensor, never h0 itself (traced by torch.compile, deltarule's op
        # already returns a fresh one: deltarule.custom_ops)
        if output_final_state and initial_state is not None and not torch.compiler.is_compiling() \
                and state.untyped_storage().data_ptr() == initial_state.untyped_storage().data_ptr():
            state = state.clone()
    if out_dtype is not None and o.dtype != out_dtype:
        o = o.to(out_dtype)
    state = state if output_final_state else None
    return (o, state, h.to(h_dtype).contiguous()) if chunk_states else (o, state)


def _with_chunk_states(call, q, k, v, *, initial_state, state_v_first, cu_seqlens, chunk_size):
    """fla's ``return_intermediate_states=True`` through `call` (`_call` with the call's other
    arguments): (o, final_state, h), h float32 ``[B, NT, HV, K, V]`` (``[..., V, K]`` with
    ``state_v_first``), the state at the start of every chunk of ``chunk_size`` tokens of every
    sequence, NT = ceil(T / chunk_size); with ``cu_seqlens``, B = 1 and NT the chunks of all
    sequences, in order (an empty sequence has none). h[:, first chunk of a sequence] is its
    initial state.

    One call of deltarule's operator computes them: a float32 slab holds the chunk starts, the
    sequences' final states and their initial states, and speculative-style token rows
    (2-D ``state_indices``) store the state after each chunk's last token into the next chunk's
    row; every other token stores nothing. The slab is in `call`'s layout (``[.., V, K]`` with
    ``state_v_first``), so that o and the final state come from the same kernel path as
    without ``return_intermediate_states`` (bit-identical)."""
    # the plain call checked first, so that a bad argument is named before a shape is read here
    spans = validate(q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens, **call.keywords).plan.spans
    B, T = q.shape[:2]
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    N = len(spans)
    lengths = [span.end - span.start for span in spans]
    chunks = [-(-n // chunk_size) for n in lengths]
    NT = sum(chunks)
    # slab rows: [0, NT) the chunk starts, [NT, NT + N) the final states, [NT + N, NT + 2N) the
    # rows the sequences read (their initial states); h0 is copied in before the operator sees it,
    # so it is checked here (rows the kernel does not store: the first chunk starts, the reads,
    # the finals of empty sequences)
    tail = (V, K) if state_v_first else (K, V)
    slab = torch.empty(NT + 2 * N, HV, *tail, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point() \
                or initial_state.shape != (N, HV, *tail):
            raise ContractError("initial_state",
                                f"a float [N={N}, HV={HV}, " + ("V, K]" if state_v_first else "K, V]"),
                                getattr(initial_state, "shape", type(initial_state).__name__))
        slab[NT:NT + N] = initial_state
        slab[NT + N:] = initial_state
    else:
        slab[NT:].zero_()
    rows = torch.full((N, max(1, max(lengths, default=0))), -1, dtype=torch.int64)
    first = 0                                        # sequence n's first chunk row
    for n, (length, count) in enumerate(zip(lengths, chunks)):
        if length == 0:
            continue                                 # padding: nothing read or written
        rows[n, 0] = NT + N + n                      # its read row (token 0's state lands there too)
        for j in range(1, count):
            rows[n, j * chunk_size - 1] = first + j  # after chunk j - 1: chunk j's start
        rows[n, length - 1] = NT + n                 # its final state (the read row if length 1)
        slab[first] = slab[NT + n]
        first += count
    o, _ = call(q, k, v, initial_state=slab, cu_seqlens=cu_seqlens, state_indices=rows.to(q.device),
                num_accepted_tokens=torch.ones(N, dtype=torch.int64, device=q.device))
    h, final = slab[:NT], slab[NT:NT + N]
    # dense: every row has ceil(T / chunk_size) chunks (named: -1 is ambiguous when B = 0)
    h = h.reshape(1, NT, *h.shape[1:]) if cu_seqlens is not None else h.reshape(B, -(-T // chunk_size), *h.shape[1:])
    return o, final.contiguous(), h


# ---------------------------------------------------------------------------
# Gated DeltaNet (fla.ops.gated_delta_rule)
# ---------------------------------------------------------------------------

def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
):
    """fla's ``chunk_gated_delta_rule`` (Gated DeltaNet, Qwen3-Next).

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (HV a multiple of H), g
    ``[B, T, HV]`` log decay (raw gate with ``use_gate_in_kernel=True`` and
    keyword ``A_log`` ``[HV]``, optional ``dt_bias`` ``[HV]``), beta
    ``[B, T, HV]``. Keyword ``chunk_size`` in (16, 32, 64). Returns
    ``(o [B, T, HV, V] in q's dtype, final_state float32 or None)``.
    ``chunk_indices`` is accepted as a scheduling hint.
    """
    kwargs, state_v_first = _kwargs("chunk_gated_delta_rule", kwargs, state_v_first,
                                    ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"))
    _refuse_unsupported(cp_context=cp_context)
    chunk_size = _check_chunk_size("chunk_gated_delta_rule", kwargs.get("chunk_size", 64), (16, 32, 64))
    _check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
    if g is None:
        raise ContractError("g", "a [B, T, HV] log-decay tensor (chunk_gated_delta_rule needs one)", None)
    gates = _scalar_gate(g, None, kwargs.get("A_log"), kwargs.get("dt_bias"),
                         use_gate_in_kernel=kwargs.get("use_gate_in_kernel", False),
                         fn="chunk_gated_delta_rule")
    beta, beta_sigmoid = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(q, k, v, out_dtype_of="q", scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, qk_l2norm=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                rule="gated_delta", beta=beta, beta_sigmoid=beta_sigmoid, **gates)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """fla's ``fused_recurrent_gated_delta_rule``.

    Note fla's positional order: ``(q, k, v, g, gk, gv, beta, ...)`` (beta is
    the 7th argument). g ``[B, T, HV]`` and gk ``[B, T, HV, K]`` are optional
    log decays (both -> both applied; neither -> the plain delta rule);
    ``use_gate_in_kernel`` turns g into the raw gate. beta defaults to ones.
    ``gv`` (per-value decay) and a per-value beta ``[B, T, HV, V]`` are not
    supported (ContractError). Returns ``(o in v's dtype, final_state or None)``.
    """
    _, state_v_first = _kwargs("fused_recurrent_gated_delta_rule", kwargs, state_v_first)
    if gv is not None:
        raise ContractError("gv", "None: per-value decay [B, T, HV, V] is not in the contract "
                                  "(decay acts on the key axis)", "a tensor")
    _check_headwise_beta(beta, v)
    if use_gate_in_kernel:
        if A_log is None:
            raise ContractError("A_log", "a [HV] tensor when use_gate_in_kernel=True", None)
        if g is None:
            raise ContractError("g", "the raw [B, T, HV] gate when use_gate_in_kernel=True", None)
    gates = _scalar_gate(g, gk, A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                         fn="fused_recurrent_gated_delta_rule")
    if beta is None and isinstance(v, torch.Tensor) and v.dim() == 4:
        # fla: torch.ones_like(q[..., 0]); ones for every value head here (fla's [B, T, H] is wrong under GVA).
        beta = torch.ones(v.shape[:3], dtype=torch.float32, device=v.device)
    beta, beta_sigmoid = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    rule = "gated_delta" if gates.get("g") is not None or gates.get("gk") is not None else "delta"
    return _run(q, k, v, out_dtype_of="v", scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, qk_l2norm=use_qk_l2norm_in_kernel,
                rule=rule, beta=beta, beta_sigmoid=beta_sigmoid, **gates)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


# ---------------------------------------------------------------------------
# KDA (fla.ops.kda)
# ---------------------------------------------------------------------------

def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """fla's ``chunk_kda`` (Kimi Delta Attention).

    g ``[B, T, HV, K]`` per-key log decay (raw gate with
    ``use_gate_in_kernel=True``, keywords ``A_log`` ``[HV]`` and optional
    ``dt_bias`` ``[HV * K]``), beta ``[B, T, HV]``. Keyword ``chunk_size`` in
    (32, 64). ``safe_gate``, ``disable_recompute``, ``use_graph`` are
    scheduling hints; ``cp_context`` raises ContractError. Returns ``(o in q's
    dtype, final_state float32 or None)``, and with
    ``return_intermediate_states=True`` (in ``torch.inference_mode()``) also
    ``h`` ``[B, NT, HV, K, V]`` in k's dtype, the state at each chunk's start
    (`_with_chunk_states`).

    Example (the states at the starts of a 150-token sequence's three 64-token chunks)::

        >>> import torch
        >>> from deltarule.contracts.fla import chunk_kda
        >>> q, k, v = (torch.randn(1, 150, 2, 16) for _ in range(3))
        >>> g, beta = -torch.rand(1, 150, 2, 16), torch.rand(1, 150, 2)
        >>> with torch.inference_mode():
        ...     o, final, h = chunk_kda(q, k, v, g, beta, output_final_state=True,
        ...                             use_qk_l2norm_in_kernel=True, return_intermediate_states=True)
        >>> tuple(h.shape), bool(h[:, 0].eq(0).all())     # no initial state: the first start is zeros
        ((1, 3, 2, 16, 16), True)
    """
    kwargs, state_v_first = _kwargs("chunk_kda", kwargs, state_v_first, ("A_log", "dt_bias", "chunk_size"))
    _refuse_unsupported(cp_context=cp_context)
    chunk_states = _check_intermediate_states(return_intermediate_states, disable_recompute)
    chunk_size = _check_chunk_size("chunk_kda", kwargs.get("chunk_size", 64), (32, 64))
    _check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
    _check_graph(use_graph, max_num_seqs, cu_seqlens)
    _check_safe_gate(safe_gate, use_gate_in_kernel, lower_bound)
    _check_headwise_beta(beta, v)
    gates = _vector_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), lower_bound,
                         use_gate_in_kernel=use_gate_in_kernel, fn="chunk_kda")
    beta, beta_sigmoid = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(q, k, v, out_dtype_of="q", scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, qk_l2norm=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                chunk_states=chunk_states, rule="gated_delta", beta=beta, beta_sigmoid=beta_sigmoid, **gates)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """fla's ``fused_recurrent_kda``: as `chunk_kda`, token by token.

    ``use_gate_in_kernel=True`` without ``A_log`` and without ``lower_bound``
    raises ContractError (fla's kernel would silently use ``A_log = 1``, i.e.
    ``-e * softplus(g + dt_bias)``, where ``chunk_kda`` raises). A per-value
    beta ``[B, T, HV, V]`` raises ContractError. Returns ``(o in v's dtype,
    final_state float32 or None)``.
    """
    _, state_v_first = _kwargs("fused_recurrent_kda", kwargs, state_v_first)
    _check_headwise_beta(beta, v)
    gates = _vector_gate(g, A_log, dt_bias, lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                         fn="fused_recurrent_kda")
    beta, beta_sigmoid = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return _run(q, k, v, out_dtype_of="v", scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, qk_l2norm=use_qk_l2norm_in_kernel,
                rule="gated_delta", beta=beta, beta_sigmoid=beta_sigmoid, **gates)


# ---------------------------------------------------------------------------
# Gated DeltaNet-2 (fla.ops.gdn2)
# ---------------------------------------------------------------------------

def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cp_context=None,
    **kwargs,
):
    """fla's ``chunk_gdn2`` (Gated DeltaNet-2).

    g ``[B, T, HV, K]`` per-key log decay (gate options as `chunk_kda`), b
    ``[B, T, HV, K]`` channel-wise erase gate, w ``[B, T, HV, V]`` channel-wise
    write gate. Keyword ``chunk_size`` must be 64. fla's chunk kernel needs
    HV == H; GVA (HV a multiple of H) is accepted here with
    `fused_recurrent_gdn2`'s meaning. Returns ``(o in q's dtype, final_state
    float32 or None)``, and ``h`` with ``return_intermediate_states=True`` (as
    `chunk_kda`).
    """
    kwargs, state_v_first = _kwargs("chunk_gdn2", kwargs, state_v_first, ("A_log", "dt_bias", "chunk_size"))
    _refuse_unsupported(cp_context=cp_context)
    chunk_states = _check_intermediate_states(return_intermediate_states, disable_recompute)
    chunk_size = _check_chunk_size("chunk_gdn2", kwargs.get("chunk_size", 64), (64,))
    _check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
    _check_safe_gate(safe_gate, use_gate_in_kernel, lower_bound)
    gates = _vector_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), lower_bound,
                         use_gate_in_kernel=use_gate_in_kernel, fn="chunk_gdn2")
    return _run(q, k, v, out_dtype_of="q", scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, qk_l2norm=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                chunk_states=chunk_states, rule="gated_delta", erase=b, write=w, **gates)


def fused_recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """fla's ``fused_recurrent_gdn2``: as `chunk_gdn2`, token by token (GVA allowed).

    Returns ``(o in v's dtype, final_state float32 or None)``.
    """
    _, state_v_first = _kwargs("fused_recurrent_gdn2", kwargs, state_v_first)
    gates = _vector_gate(g, A_log, dt_bias, lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                         fn="fused_recurrent_gdn2")
    return _run(q, k, v, out_dtype_of="v", scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, qk_l2norm=use_qk_l2norm_in_kernel,
                rule="gated_delta", erase=b, write=w, **gates)

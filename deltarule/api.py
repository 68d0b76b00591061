"""The public operator `linear_attention`: its arguments and their defaults; validation is
`deltarule.validation`, the eager path `deltarule.eager`, the traced one `deltarule.custom_ops`."""

from __future__ import annotations

import torch

from . import arguments, custom_ops, eager
from .batch import BatchPlan
from .validation import finite_float32, validate  # noqa: F401  (the package's and the adapters' names)

_is_compiling = torch.compiler.is_compiling


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
    capture: torch.Tensor | None = None,
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
            (`deltarule.WgslStateSlab`) runs on its own backend.
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
        capture: None, or a float32 contiguous [N, C * (Dw + Hk*K + Hv*V)]
            buffer (q's device; C >= 1 the capacity; Dw = Hv*K with `gk`,
            else Hv) written IN PLACE with the factors of each sequence's
            first min(C, length) transitions, ONNX Runtime's compact
            `state_update` layout (docs/design.md, "Compact capture"): row n
            holds C decay factors exp(g + gk) [Dw], then C keys (after
            `qk_l2norm`) [Hk, K], then C deltas w*v - S'^T (b*k) [Hv, V], so
            that S_t = diag(decay) S_{t-1} + key delta^T (`deltarule.replay`).
            Entries past a sequence's count are left as they were. The call
            runs token by token. With a slab (1-D `state_indices`) it is a
            verify: the rows are read and NOT written (replay commits).
            Refused with gradients or 2-D `state_indices`; under torch.compile
            the call is a graph break (it runs eagerly).
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

    Compact capture (speculative decoding without per-token rows): verify the
    3 draft tokens reading row 0 and 4, keep the factors, commit 2 and 3::

        >>> C = 3
        >>> capture = torch.empty(2, C * (H + H * K + H * V))
        >>> before = slab.clone()
        >>> o, _ = deltarule.linear_attention(
        ...     q, k, v, g=-torch.rand(2, 3, H), beta=torch.rand(2, 3, H),
        ...     initial_state=slab, state_indices=torch.tensor([0, 4]), capture=capture)
        >>> bool(torch.equal(slab, before))                  # a verify writes no row
        True
        >>> _ = deltarule.replay(slab, capture, torch.tensor([2, 3]), key_heads=H,
        ...                      state_indices=torch.tensor([0, 4]))
    """
    if _is_compiling():
        return custom_ops.call({**locals(), "accept_growth": False})
    # positional, in the record's order (deltarule.arguments; checked by tests/test_arguments.py)
    return eager.run(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, cu_seqlens,
                      seq_lens, state_indices, num_accepted_tokens, plan, qk_l2norm, l2norm_eps, A_log, dt_bias,
                      beta_sigmoid, chunk_size, capture, backend, False)


def call(q, k, v, *, rule="gated_delta", g=None, gk=None, beta=None, erase=None, write=None, scale=None,
         initial_state=None, state_layout="kv", cu_seqlens=None, seq_lens=None, state_indices=None,
         num_accepted_tokens=None, plan=None, qk_l2norm=False, l2norm_eps=1e-6, A_log=None, dt_bias=None,
         beta_sigmoid=False, chunk_size=64, capture=None, backend="auto", accept_growth=False):
    """`linear_attention` for the contract adapters: the same arguments, plus `accept_growth`
    (see `validate`): the adapters of runtimes that take positive log decays pass True."""
    if _is_compiling():
        return custom_ops.call(locals())
    return eager.run(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, cu_seqlens,
                      seq_lens, state_indices, num_accepted_tokens, plan, qk_l2norm, l2norm_eps, A_log, dt_bias,
                      beta_sigmoid, chunk_size, capture, backend, accept_growth)


arguments.check_signature(linear_attention)
arguments.check_signature(call, internal=True)

"""Ascend's `aclnnRecurrentGatedDeltaRule` (CANN ops-transformer) on top of `deltarule.linear_attention`.

    from deltarule.contracts.ascend import recurrent_gated_delta_rule
    out = recurrent_gated_delta_rule(query, key, value, beta, state, actual_seq_lengths,
                                     ssm_state_indices, g=g, num_accepted_tokens=accepted)

The NPU operator's arguments (aclnn's camelCase names in snake_case:
`stateRef` is `state`, `actualSeqLengths` is `actual_seq_lengths`, ...),
dtypes, limits and golden semantics, from its public operator documentation
and test golden (CANN ops-transformer, attention/recurrent_gated_delta_rule/):

- B sequences of L_i tokens (0 < L_i <= 8) packed along T = sum L_i;
  query / key (T, Nk, Dk), value (T, Nv, Dv), beta (T, Nv), BF16; value head
  h reads key head h // (Nv / Nk); Nk, Nv, Dk, Dv <= 256.
- `state` is the V-major slab (BlockNum, Nv, Dv, Dk), BF16 or FP32, UPDATED
  IN PLACE: token j stores its post-update state into row
  ssm_state_indices[j]; sequence i starts from row
  ssm_state_indices[seq_start + num_accepted_tokens[i] - 1] (the last
  accepted draft token of speculative decoding), or its first token's row.
- g (T, Nv) / gk (T, Nv, Dk) FP32 log decays, either, both or neither.
- out (T, Nv, Dv) BF16, out = S (q * scale_value), scale default 1/sqrt(Dk).

The adapter is strict where the NPU is: it accepts only what the parameter
table lists, so code checked against it runs on the NPU. One restriction is
deltarule's own: the rows a call writes (`ssm_state_indices`) must be
distinct. Every refusal is a `deltarule.ContractError` naming the Ascend
argument, raised before anything is modified. Inputs are torch tensors or
NumPy arrays (`deltarule.contracts._convert`); `out` comes back in the kind
of `query`, and a NumPy `state` is updated in the caller's array.
"""

from __future__ import annotations

import itertools

import torch

from ..aliasing import check_written
from ..api import call as _call
from ..errors import ContractError
from ._convert import Kind, dtype_name
from ._checks import check_rows, check_scale, check_tensor, host_ints, state_tensor, write_back

__all__ = ["recurrent_gated_delta_rule", "MAX_SEQ_LEN", "MAX_HEADS", "MAX_HEAD_DIM"]

# The operator's shape limits: L_i <= 8; Nk, Nv <= 256; Dk, Dv <= 256 (later CANN docs allow 512 for
# Dk / Dv; the seed's 256 is kept so that a call accepted here runs on every build).
MAX_SEQ_LEN = 8
MAX_HEADS = 256
MAX_HEAD_DIM = 256

_BF16 = (torch.bfloat16,)
_STATE_DTYPES = (torch.bfloat16, torch.float32)     # FP32 "in some builds"
_FP32 = (torch.float32,)


def recurrent_gated_delta_rule(query, key, value, beta, state, actual_seq_lengths, ssm_state_indices,
                               g=None, gk=None, num_accepted_tokens=None, scale_value=None):
    """aclnnRecurrentGatedDeltaRule: returns `out`; `state` is updated in place.

    Args:
        query: (T, Nk, Dk) bfloat16, the tokens of all B sequences packed;
            1 <= Nk <= 256, 1 <= Dk <= 256.
        key: (T, Nk, Dk) bfloat16.
        value: (T, Nv, Dv) bfloat16; Nv a multiple of Nk, at most 256 (value
            head h reads query / key head h // (Nv / Nk)); 1 <= Dv <= 256.
        beta: (T, Nv) bfloat16 update rate.
        state: (BlockNum, Nv, Dv, Dk) bfloat16 or float32, the V-major slab
            (`stateRef`). UPDATED IN PLACE: exactly the rows
            `ssm_state_indices` names are rewritten (rounded to nearest even
            for bfloat16), the others keep their bits. A NumPy array must be
            writeable.
        actual_seq_lengths: (B,) int32, B >= 1, each L_i in [1, 8],
            sum(L_i) == T.
        ssm_state_indices: (T,) int32 in [0, BlockNum), one slab row per
            token, distinct (deltarule's restriction; see docs/contracts.md).
        g: optional (T, Nv) float32 scalar log decay (natural log); absent: 0.
        gk: optional (T, Nv, Dk) float32 per-key log decay; absent: 0. May
            come with `g`.
        num_accepted_tokens: optional (B,) int32, 1 <= a_i <= L_i: sequence
            i starts from the state of row
            ssm_state_indices[seq_start_i + a_i - 1]; absent: from
            ssm_state_indices[seq_start_i].
        scale_value: output scale, a finite float; default 1 / sqrt(Dk).

    Returns:
        out: (T, Nv, Dv) bfloat16 (the kind of `query`: NumPy in, NumPy out).

    Raises:
        ContractError: an argument the operator (or deltarule, for repeated
            rows) rejects, named as in the signature, before any work;
            `state` is then untouched.

    Example:
        >>> import torch
        >>> from deltarule.contracts.ascend import recurrent_gated_delta_rule
        >>> Nk, Nv, Dk, Dv = 2, 4, 16, 16
        >>> lengths = torch.tensor([3, 1], dtype=torch.int32)      # B = 2 sequences, T = 4
        >>> q, k = (torch.randn(4, Nk, Dk).bfloat16() for _ in range(2))
        >>> k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
        >>> v, beta = torch.randn(4, Nv, Dv).bfloat16(), torch.rand(4, Nv).bfloat16()
        >>> slab = torch.randn(8, Nv, Dv, Dk).bfloat16()
        >>> before = slab.clone()
        >>> rows = torch.tensor([5, 6, 7, 2], dtype=torch.int32)   # one row per token
        >>> out = recurrent_gated_delta_rule(
        ...     q, k, v, beta, slab, lengths, rows, g=-torch.rand(4, Nv),
        ...     num_accepted_tokens=torch.tensor([2, 1], dtype=torch.int32))  # seq 0 starts from row 6
        >>> out.shape, out.dtype
        (torch.Size([4, 4, 16]), torch.bfloat16)
        >>> [r for r in range(8) if not torch.equal(slab[r], before[r])]
        [2, 5, 6, 7]
    """
    kind = Kind("query", query)
    q = kind.tensor("query", query, optional=False)
    if q.dim() != 3:
        raise ContractError("query", "a rank-3 (T, Nk, Dk) tensor", f"shape {list(q.shape)}")
    T, Nk, Dk = q.shape
    device = q.device
    if not (1 <= Nk <= MAX_HEADS and 1 <= Dk <= MAX_HEAD_DIM):
        raise ContractError("query", f"(T, Nk, Dk) with 1 <= Nk <= {MAX_HEADS}, 1 <= Dk <= {MAX_HEAD_DIM}",
                            f"shape {list(q.shape)}")
    if q.dtype not in _BF16:
        raise ContractError("query", "dtype bfloat16 (BF16)", dtype_name(q.dtype))
    k = kind.tensor("key", key, optional=False)
    check_tensor("key", k, shape=(T, Nk, Dk), letters="(T, Nk, Dk)", dtypes=_BF16, device=device)
    v = kind.tensor("value", value, optional=False)
    if v.dim() != 3 or v.shape[0] != T:
        raise ContractError("value", f"a rank-3 (T, Nv, Dv) tensor with T = {T}", f"shape {list(v.shape)}")
    Nv, Dv = v.shape[1], v.shape[2]
    if not (1 <= Nv <= MAX_HEADS and Nv % Nk == 0 and 1 <= Dv <= MAX_HEAD_DIM):
        raise ContractError("value", f"(T, Nv, Dv) with Nv a multiple of Nk = {Nk}, Nv <= {MAX_HEADS}, "
                            f"1 <= Dv <= {MAX_HEAD_DIM}", f"shape {list(v.shape)}")
    check_tensor("value", v, shape=(T, Nv, Dv), letters="(T, Nv, Dv)", dtypes=_BF16, device=device)
    b = kind.tensor("beta", beta, optional=False)
    check_tensor("beta", b, shape=(T, Nv), letters="(T, Nv)", dtypes=_BF16, device=device)

    slab = state_tensor(kind, "state", state)
    check_tensor("state", slab, shape=(slab.shape[0], Nv, Dv, Dk), letters="(BlockNum, Nv, Dv, Dk)",
                 dtypes=_STATE_DTYPES, device=device)
    block_num = slab.shape[0]

    lengths_t = kind.tensor("actual_seq_lengths", actual_seq_lengths, optional=False)
    if lengths_t.dim() != 1 or lengths_t.shape[0] < 1:
        raise ContractError("actual_seq_lengths", "a (B,) tensor with B >= 1", f"shape {list(lengths_t.shape)}")
    B = lengths_t.shape[0]
    lengths = host_ints("actual_seq_lengths", lengths_t, length=B, letters="(B,)", device=device)
    for i, n in enumerate(lengths):
        if not 0 < n <= MAX_SEQ_LEN:
            raise ContractError("actual_seq_lengths", f"0 < L_i <= {MAX_SEQ_LEN}", f"actual_seq_lengths[{i}] = {n}")
    if sum(lengths) != T:
        raise ContractError("actual_seq_lengths", f"sum(L_i) == T = {T} (query's tokens)", f"sum {sum(lengths)}")
    indices = host_ints("ssm_state_indices", kind.tensor("ssm_state_indices", ssm_state_indices, optional=False),
                        length=T, letters="(T,)", device=device)
    # Ascend's docs do not say whether a row may be named twice (on the NPU the later store presumably
    # wins); deltarule writes each row of a call at most once, so a repeat is refused.
    check_rows("ssm_state_indices", indices, block_num, why="deltarule stores each row at most once per call")

    gates = {}
    for name, x, shape, letters in (("g", g, (T, Nv), "(T, Nv)"), ("gk", gk, (T, Nv, Dk), "(T, Nv, Dk)")):
        t = kind.tensor(name, x)
        if t is not None:
            check_tensor(name, t, shape=shape, letters=letters, dtypes=_FP32, device=device)
            gates[name] = t[None]
    accepted_t = kind.tensor("num_accepted_tokens", num_accepted_tokens)
    if accepted_t is not None:
        accepted = host_ints("num_accepted_tokens", accepted_t, length=B, letters="(B,)", device=device)
        for i, (a, n) in enumerate(zip(accepted, lengths)):
            if not 1 <= a <= n:
                raise ContractError("num_accepted_tokens", "1 <= num_accepted_tokens[i] <= L_i",
                                    f"num_accepted_tokens[{i}] = {a} with L_{i} = {n}")
    scale = check_scale("scale_value", scale_value)
    check_written("state", slab, (("query", q), ("key", k), ("value", v), ("beta", b),
                                  ("g", kind.tensor("g", g)), ("gk", kind.tensor("gk", gk))))

    # Token t of sequence i stores into column t of row i; columns past L_i are never written (-1).
    starts = [0, *itertools.accumulate(lengths)]
    L = max(lengths)
    rows = [indices[start:end] + [-1] * (L - (end - start)) for start, end in zip(starts, starts[1:])]
    out, _ = _call(
        q[None], k[None], v[None], rule="gated_delta" if gates else "delta", beta=b[None], scale=scale,
        initial_state=slab, state_layout="vk",
        cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
        state_indices=torch.tensor(rows, dtype=torch.int32, device=device),
        num_accepted_tokens=accepted_t, **gates,
        accept_growth=True,  # the runtime takes any log decay; linear_attention refuses > 0
    )
    write_back(state, slab, indices)
    return kind.out(out[0])


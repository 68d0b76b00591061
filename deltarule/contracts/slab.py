"""The `gated_delta_update` slab operator (gatedDeltaUpdate) on top of `deltarule.linear_attention`.

    from deltarule.contracts.slab import gated_delta_update
    o = gated_delta_update(query, key, value, beta, gate, state, seq_lens, slot_ids)

One gated delta-rule step over a batch of rows, with the runtime's semantics
(from its binding card, the `gatedDeltaUpdate` operator reference):
per token the float32 K-major state S [K, V] decays by exp(g), takes the
rank-1 update (beta * k) (v - S^T k)^T, and emits o = (scale * q)^T S; the
state is updated IN PLACE. With `slot_ids`, `state` is a slab of rows and
batch row b reads and updates row slot_ids[b]; without, batch row b is state
row b. The gate's rank picks scalar (`g`) or per-key (`gk`) decay; with
`gate_bias` and `gate_scale` it is the raw projection and the decay is
gate_scale * softplus(gate + gate_bias), deltarule's raw-gate arm with
A_log = log(-gate_scale).

Inputs are torch tensors or NumPy arrays (`deltarule.contracts._convert`);
`o` comes back in the kind of `query`, and a NumPy `state` is updated in the
caller's array. A call the operator rejects raises `deltarule.ContractError`
naming the operator's argument, before anything is modified.
"""

from __future__ import annotations

import torch

from ..aliasing import check_written
from ..api import call as _call
from ..errors import ContractError
from ._checks import check_rows, check_scale, check_tensor, float32_or, host_ints, names, state_tensor, write_back
from ._convert import Kind, dtype_name

__all__ = ["gated_delta_update"]

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gated_delta_update(query, key, value, beta, gate, state, seq_lens=None, slot_ids=None, scale=None,
                       gate_bias=None, gate_scale=None):
    """gatedDeltaUpdate: one gated delta-rule pass over `B` rows of `T` tokens; `state` updated in place.

    Args:
        query: [B, T, H, K] float32 / float16 / bfloat16 (the activations'
            dtype), B >= 1, H >= 1, K >= 1.
        key: [B, T, H, K], query's dtype.
        value: [B, T, HV, V], query's dtype; HV a multiple of H (value head h
            reads query / key head h // (HV / H)), V >= 1.
        beta: [B, T, HV] update rate, used as is (no sigmoid); float32 or the
            activations' dtype.
        gate: its rank picks the family: [B, T, HV] one log decay per value
            head, or [B, T, HV, K] one per key channel. Without `gate_bias` /
            `gate_scale` it IS the natural-log decay, float32 or the
            activations' dtype; with them it is the raw gate projection, in
            the activations' dtype.
        state: [num_slots, HV, K, V] float32, K-major; UPDATED IN PLACE (the
            rows named by `slot_ids`, or every row without it; a NumPy array
            must be writeable).
        seq_lens: optional [B] int32 in [0, T]: row b's tokens past
            seq_lens[b] are padding, their outputs are zero and the state is
            the one after token seq_lens[b] - 1 (unchanged for 0). Default:
            every row has T tokens.
        slot_ids: optional [B] int32, distinct, in [0, num_slots): batch row b
            reads and updates state row slot_ids[b]; other rows are not
            touched. Default: row b is state row b (num_slots must be B).
        scale: output scale, a finite float; default K ** -0.5.
        gate_bias: [HV] float32 beside a [B, T, HV] gate, or [HV, K] beside a
            [B, T, HV, K] one (the checkpoint's dt_bias); with `gate_scale`.
        gate_scale: [HV] float32, the folded -exp(A_log), every value <= 0
            (0 gives a zero decay rate: decay factor 1); with `gate_bias`.
            The decay is then gate_scale * softplus(gate + gate_bias), in
            float32.

    Returns:
        o: [B, T, HV, V] in value's dtype (the kind of `query`: NumPy in,
        NumPy out).

    Raises:
        ContractError: an argument the operator rejects (named as here),
            before any work; `state` is then untouched.

    Example:
        >>> import torch
        >>> from deltarule.contracts.slab import gated_delta_update
        >>> B, T, H, K, V = 2, 3, 2, 8, 8
        >>> q, k, v = (torch.randn(B, T, H, d) for d in (K, K, V))
        >>> k = torch.nn.functional.normalize(k, dim=-1)
        >>> slab = torch.zeros(5, H, K, V)
        >>> o = gated_delta_update(q, k, v, torch.rand(B, T, H), -torch.rand(B, T, H), slab,
        ...                        seq_lens=torch.tensor([3, 1], dtype=torch.int32),
        ...                        slot_ids=torch.tensor([4, 1], dtype=torch.int32))
        >>> tuple(o.shape), bool(o[1, 1:].eq(0).all())
        ((2, 3, 2, 8), True)
        >>> [bool(slab[r].ne(0).any()) for r in range(5)]
        [False, True, False, False, True]
    """
    kind = Kind("query", query)
    q = kind.tensor("query", query, optional=False)
    k = kind.tensor("key", key, optional=False)
    v = kind.tensor("value", value, optional=False)
    if q.dim() != 4:
        raise ContractError("query", "a rank-4 [B, T, H, K] tensor", f"shape {list(q.shape)}")
    B, T, H, K = q.shape
    if B < 1 or H < 1 or K < 1:
        raise ContractError("query", "[B, T, H, K] with B, H, K >= 1", f"shape {list(q.shape)}")
    act = q.dtype
    device = q.device
    if act not in ACTIVATION_DTYPES:
        raise ContractError("query", "dtype " + names(ACTIVATION_DTYPES), dtype_name(act))
    check_tensor("key", k, shape=(B, T, H, K), letters="[B, T, H, K]", dtypes=(act,), device=device)
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T) or v.shape[2] < 1 or v.shape[2] % H or v.shape[3] < 1:
        raise ContractError("value", f"[B, T, HV, V] = [{B}, {T}, a multiple of H = {H}, V >= 1]",
                            f"shape {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    check_tensor("value", v, shape=(B, T, HV, V), letters="[B, T, HV, V]", dtypes=(act,), device=device)
    b = kind.tensor("beta", beta, optional=False)
    check_tensor("beta", b, shape=(B, T, HV), letters="[B, T, HV]", dtypes=float32_or(act), device=device)

    bias, rate = kind.tensor("gate_bias", gate_bias), kind.tensor("gate_scale", gate_scale)
    if (bias is None) != (rate is None):
        missing = "gate_scale" if rate is None else "gate_bias"
        raise ContractError(missing, "gate_bias and gate_scale together (the raw-gate form)", f"{missing} = None")
    raw = bias is not None
    d = kind.tensor("gate", gate, optional=False)
    if d.dim() not in (3, 4):
        raise ContractError("gate", f"[B, T, HV] = [{B}, {T}, {HV}] or [B, T, HV, K] = [{B}, {T}, {HV}, {K}]",
                            f"shape {list(d.shape)}")
    per_key = d.dim() == 4
    # the raw projection comes at the activations' dtype (the card); a log decay may be float32 too
    check_tensor("gate", d, shape=(B, T, HV, K) if per_key else (B, T, HV),
                 letters="[B, T, HV, K]" if per_key else "[B, T, HV]",
                 dtypes=(act,) if raw else float32_or(act), device=device)

    slab = state_tensor(kind, "state", state)
    check_tensor("state", slab, shape=(slab.shape[0], HV, K, V), letters="[num_slots, HV, K, V]",
                 dtypes=(torch.float32,), device=device)
    num_slots = slab.shape[0]

    A_log = None
    if raw:
        check_tensor("gate_bias", bias, shape=(HV, K) if per_key else (HV,),
                     letters="[HV, K] (beside a per-key gate)" if per_key else "[HV] (beside a [B, T, HV] gate)",
                     dtypes=(torch.float32,), device=device)
        check_tensor("gate_scale", rate, shape=(HV,), letters="[HV]", dtypes=(torch.float32,), device=device)
        for h, x in enumerate(rate.tolist()):
            if x > 0:                              # -exp(A_log) is never positive (NaN propagates as in the kernel)
                raise ContractError("gate_scale", "values <= 0 (the folded -exp(A_log))", f"gate_scale[{h}] = {x}")
        # -exp(log(-gate_scale)) is gate_scale to float32 rounding; log(0) = -inf gives rate 0, decay 1
        A_log = torch.log(-rate.to(torch.float64)).to(torch.float32)

    lengths = kind.tensor("seq_lens", seq_lens)
    if lengths is not None:
        for i, n in enumerate(host_ints("seq_lens", lengths, length=B, letters="[B]", device=device)):
            if not 0 <= n <= T:
                raise ContractError("seq_lens", f"lengths in [0, T = {T}]", f"seq_lens[{i}] = {n}")
    slots = kind.tensor("slot_ids", slot_ids)
    if slots is not None:
        rows = host_ints("slot_ids", slots, length=B, letters="[B]", device=device)
        check_rows("slot_ids", rows, num_slots, why="gatedDeltaUpdate's contract: one row per batch row")
    else:
        if num_slots != B:
            raise ContractError("state", f"[B, HV, K, V] with B = {B} rows without slot_ids",
                                f"shape {list(slab.shape)}")
        rows = list(range(B))
        slots = torch.arange(B, dtype=torch.int32, device=device)
    scale = check_scale("scale", scale)
    check_written("state", slab, (("query", q), ("key", k), ("value", v), ("gate", d), ("beta", b),
                                  ("gate_bias", bias), ("gate_scale", rate)))

    o, _ = _call(
        q, k, v, rule="gated_delta", g=None if per_key else d, gk=d if per_key else None, beta=b,
        scale=scale, initial_state=slab, state_layout="kv", seq_lens=lengths, state_indices=slots,
        A_log=A_log, dt_bias=bias,
        accept_growth=True,  # the runtime takes any log decay; linear_attention refuses > 0
    )
    write_back(state, slab, rows)
    return kind.out(o)

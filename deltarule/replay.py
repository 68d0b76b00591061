"""`replay`: roll states forward by transitions a call captured (`linear_attention(capture=)`).

A captured transition is three factors (docs/design.md, "Compact capture"): the decay
factors d (per head, or per head and key), the key k [Hk, K] and the delta u [Hv, V], and
it applies as one rank-1 update per state head h (key head h // (Hv / Hk)):

    S <- diag(d_h) S + k_h u_h^T          (K-major S [K, V])

which is exactly the step the call took, so replaying a verify call's first n transitions
onto the state it read gives the state after its n-th token. Speculative decoding keeps
these factors instead of a state per draft token and replays the accepted count.
"""

from __future__ import annotations

import torch

from .errors import ContractError
from .kernels.cpu import replay as _native
from .problem import STATE_DTYPES, capture_parts


def replay(state, capture, count, *, key_heads, per_key_decay=False, state_indices=None, state_layout="kv"):
    """Apply the first `count[n]` transitions of capture row n to state row n, in place.

    Args:
        state: [N, Hv, K, V] ("kv") or [N, Hv, V, K] ("vk"), float32 / bfloat16 /
            float16, updated IN PLACE (16-bit: computed in float32, stored rounded to
            nearest even, as `linear_attention` stores). With `state_indices` a slab
            [S, Hv, ...] whose rows are addressed.
        capture: [N, C * (Dw + Hk*K + Hv*V)] float32, a buffer `linear_attention`
            filled (`capture=`), C >= 1; Dw = Hv*K with `per_key_decay`, else Hv.
            Read only.
        count: [N] int, in [0, C]: the transitions to apply (the accepted tokens);
            read to the host. A count beyond what the call captured (its sequence's
            length) replays unspecified entries: the caller's to avoid.
        key_heads: Hk, the call's key heads (the capture keeps the keys shared).
        per_key_decay: the call had per-key decay (`gk`): Dw = Hv * K.
        state_indices: None, or [N] int slab rows, distinct among the rows replayed;
            a negative row (padding) or a count of 0 leaves the slab alone.
        state_layout: "kv" (default) or "vk", the layout of `state`.

    Returns:
        `state`, updated in place. Every row is read before any is written.

    Raises:
        ContractError: any invalid argument, before any work.

    Example:
        >>> import torch, deltarule
        >>> q, k, v = (torch.randn(1, 3, 2, 4) for _ in range(3))
        >>> k = torch.nn.functional.normalize(k, dim=-1)
        >>> g, beta = -torch.rand(1, 3, 2), torch.rand(1, 3, 2)
        >>> capture = torch.empty(1, 3 * (2 + 2 * 4 + 2 * 4))
        >>> _, after = deltarule.linear_attention(q, k, v, g=g, beta=beta, capture=capture)
        >>> state = torch.zeros(1, 2, 4, 4)
        >>> _ = deltarule.replay(state, capture, torch.tensor([3]), key_heads=2)
        >>> bool(torch.allclose(state, after, atol=1e-6))
        True
    """
    rows, counts, parts, layout = _validate(state, capture, count, key_heads, per_key_decay, state_indices,
                                            state_layout)
    live = [n for n, c in enumerate(counts) if c > 0 and rows[n] >= 0]
    if not live:
        return state
    if state.device.type == "cpu" and state.is_contiguous() and _native.available():
        decay, key, delta = parts                   # one pass over each row, in place (csrc/replay.c)
        _native.replay(state, state_layout == "vk", capture, rows, counts, C=decay.shape[1], Hk=key.shape[2],
                       K=key.shape[3], V=delta.shape[3], Dw=decay.shape[2])
        return state
    picked = torch.tensor([rows[n] for n in live], device=state.device)
    steps = torch.tensor([counts[n] for n in live], device=state.device)
    S = layout(state[picked].to(torch.float32)).contiguous()            # every read first
    if len(live) < len(rows):
        parts = tuple(part[picked.new_tensor(live)] for part in parts)
    S = _advance(S, *parts, steps)
    state.index_copy_(0, picked, layout(S).to(state.dtype))
    return state


def _advance(S, decay, key, delta, steps):
    """S [n, Hv, K, V] float32 after `steps[i]` transitions of row i (states off the CPU, or
    strided; the native kernel's twin), in closed form: the decays
    are diagonal, so they commute, and n rank-1 updates are one product,

        S_n = diag(prod_t d_t) S + sum_t diag(prod_{s > t} d_s) k_t u_t^T,

    one pass over the state (a scale and a batched matrix product) instead of one per
    transition. Steps past a row's count are identities (d = 1, k = 0)."""
    n, C = decay.shape[:2]
    Hv, K, V = S.shape[1:]
    kept = (torch.arange(C, device=S.device) < steps[:, None]).view(n, C, 1, 1)
    d = torch.where(kept, decay.view(n, C, Hv, -1), 1.0)                 # [n, C, Hv, 1 | K]
    k = torch.where(kept, key.repeat_interleave(Hv // key.shape[2], dim=2), 0.0)   # [n, C, Hv, K]
    # after[t] = prod_{s > t} d_s: a reversed exclusive cumulative product (no division by a decay)
    after = torch.ones_like(d)
    after[:, :-1] = d.flip(1).cumprod(1).flip(1)[:, 1:]
    total = after[:, 0] * d[:, 0]                                         # [n, Hv, 1 | K]
    weighted = (after * k).permute(0, 2, 3, 1).reshape(n * Hv, K, C)    # [n*Hv, K, C]
    u = delta.permute(0, 2, 1, 3).reshape(n * Hv, C, V)
    S = S * total[..., None]
    return S.view(n * Hv, K, V).baddbmm_(weighted, u).view(n, Hv, K, V)


def _validate(state, capture, count, key_heads, per_key_decay, state_indices, state_layout):
    """(rows [N] host ints, counts [N] host ints, capture_parts, the layout's K-major view)."""
    if not isinstance(state, torch.Tensor):
        raise ContractError("state", "a torch.Tensor", type(state).__name__)
    if state.dim() != 4 or state.dtype not in STATE_DTYPES:
        raise ContractError("state", "a rank-4 float32 / bfloat16 / float16 tensor",
                            f"shape {list(state.shape)}, dtype {state.dtype}")
    if state_layout not in ("kv", "vk"):
        raise ContractError("state_layout", "'kv' | 'vk'", repr(state_layout))
    Hv = state.shape[1]
    K, V = (state.shape[2], state.shape[3]) if state_layout == "kv" else (state.shape[3], state.shape[2])
    if isinstance(key_heads, bool) or not isinstance(key_heads, int) or key_heads < 1 or Hv % key_heads:
        raise ContractError("key_heads", f"an int >= 1 dividing Hv = {Hv}", repr(key_heads))
    if not isinstance(per_key_decay, bool):
        raise ContractError("per_key_decay", "a bool", repr(per_key_decay))
    if not isinstance(capture, torch.Tensor) or capture.dtype != torch.float32 or capture.dim() != 2:
        raise ContractError("capture", "a rank-2 float32 torch.Tensor",
                            getattr(capture, "shape", type(capture).__name__))
    if capture.device != state.device:
        raise ContractError("capture", f"device {state.device} (state's)", capture.device)
    Dw = Hv * K if per_key_decay else Hv
    width = Dw + key_heads * K + Hv * V
    if capture.shape[1] < width or capture.shape[1] % width or not capture.is_contiguous():
        raise ContractError("capture", f"contiguous [N, C * (Dw + Hk*K + Hv*V)] = [N, C * {width}], C >= 1",
                            f"shape {list(capture.shape)}")
    C, N = capture.shape[1] // width, capture.shape[0]
    counts = _host_ints("count", count, N)
    for n, c in enumerate(counts):
        if not 0 <= c <= C:
            raise ContractError(f"count[{n}]", f"an int in [0, C = {C}]", c)
    if state_indices is None:
        if state.shape[0] != N:
            raise ContractError("state", f"{N} rows (capture's), or a slab with state_indices",
                                f"shape {list(state.shape)}")
        rows = list(range(N))
    else:
        rows = _host_ints("state_indices", state_indices, N)
        seen = {}
        for n, (r, c) in enumerate(zip(rows, counts)):
            if r >= state.shape[0]:
                raise ContractError(f"state_indices[{n}]", f"a row < {state.shape[0]} (the slab's rows)", r)
            if r >= 0 and c > 0:
                if r in seen:
                    raise ContractError(f"state_indices[{n}]", "distinct rows among the rows replayed",
                                        f"{r} repeated (also state_indices[{seen[r]}])")
                seen[r] = n
    layout = (lambda x: x.transpose(-1, -2)) if state_layout == "vk" else (lambda x: x)  # noqa: E731
    return rows, counts, capture_parts(capture, C, Dw, key_heads, K, Hv, V), layout


def _host_ints(name, x, N) -> list[int]:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or x.shape != (N,):
        raise ContractError(name, f"an int32 / int64 tensor of shape [{N}]",
                            f"{type(x).__name__} {getattr(x, 'dtype', '')} {list(getattr(x, 'shape', []))}")
    return x.tolist()

"""Context-parallel prefill over `torch.distributed`: the token axis split across ranks.

Every rank holds a contiguous slice of the tokens, in rank order, and calls
`linear_attention` here with the same arguments otherwise. The result on each rank
is its slice of the outputs and the final states of the whole sequences, equal to
one `deltarule.linear_attention` over all the tokens.

How (docs/distributed.md): per token the state update is affine in the state,
``S_t = A_t S_{t-1} + k_t (w_t * v_t)^T`` with ``A_t = (I - k_t (b_t * k_t)^T) D_t``,
so a slice maps its incoming state by ``S -> M S + X`` (``M`` the product of the
``A_t``, ``X`` the slice's state from zero). deltarule's own kernels give both in
one pass: the slice runs with ``K`` extra value columns that are zero and start
from the identity (state ``[I | 0]``, values ``[0 | v]``); the extra columns end
as ``M``, the others as ``X``, and the extra output columns are
``scale * P_t^T q_t`` (``P_t`` the transition up to token t), so the true outputs
are ``o_t = o0_t + S_in^T (scale * P_t^T q_t)``: no second pass over the tokens
once the incoming state is known. One all-gather of ``X`` (``[K, V]``) per head and
sequence piece and ``M`` (``[K, K]``) per continued piece (and a first all-gather of
21 integers per rank: token count, status and a digest of the arguments the ranks must
agree on) is all that is communicated: independent of T. The chain runs in float32
with no division, so strong decay (``M`` underflowing to 0) is safe.
"""

from __future__ import annotations

import array
import hashlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api, arguments
from .errors import ContractError

__all__ = ["linear_attention", "Piece", "pieces"]


@dataclass(frozen=True)
class Piece:
    """The tokens ``[start, end)`` of a rank's slice (local indices) that belong to sequence `sequence`.

    ``continued``: the sequence has tokens on an earlier rank, so the piece's state at
    ``start`` comes from there.
    """

    sequence: int
    start: int
    end: int
    continued: bool


def pieces(lengths: list[int], cu_seqlens: list[int] | None, batch: int) -> list[list[Piece]]:
    """Each rank's pieces, from every rank's token count `lengths` (ranks in order).

    Packed (`cu_seqlens` given): the ranks' slices of the flat token axis cut the
    sequences; empty sequences have no piece. Padded (`cu_seqlens` None): every
    rank with tokens holds a piece of each of the `batch` rows.

    >>> [[(p.sequence, p.start, p.end, p.continued) for p in r] for r in pieces([3, 4], [0, 2, 2, 7], 1)]
    [[(0, 0, 2, False), (2, 2, 3, False)], [(2, 0, 4, True)]]
    """
    result, offset = [], 0
    for length in lengths:
        if cu_seqlens is None:
            held = [Piece(b, 0, length, offset > 0) for b in range(batch)] if length else []
        else:
            held = [Piece(s, max(lo, offset) - offset, min(hi, offset + length) - offset, lo < offset)
                    for s, (lo, hi) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:]))
                    if max(lo, offset) < min(hi, offset + length)]
        result.append(held)
        offset += length
    return result


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
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
    qk_l2norm: bool = False,
    l2norm_eps: float = 1e-6,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltarule.linear_attention` over a token axis split across the ranks of `group`.

    Every rank calls it (a collective) with its slice of the tokens and the same
    other arguments. The arguments are `deltarule.linear_attention`'s, with these
    differences:

    Args:
        q, k, v, g, gk, beta, erase, write: this rank's slice of the token axis
            (dimension 1), ranks in rank order: ``[B, T_r, ...]``. T_r may differ
            between ranks and may be 0.
        group: the process group (default: the world). gloo (CPU) and NCCL; the
            tensors live on the device the backend needs.
        cu_seqlens: packed sequences: B = 1 and the *global* ``[N + 1]`` offsets
            over all ranks' tokens, the same on every rank (``cu_seqlens[-1]`` is
            the total token count). Sequences may cross rank boundaries and a rank
            may hold no token of a sequence. None: each of the B rows is one
            sequence split along T.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with ``state_layout="vk"``),
            the same on every rank (its values are compared); None starts from zero.
        A_log, dt_bias: the same on every rank (compared).
        Not accepted: ``seq_lens``, ``state_indices``, ``num_accepted_tokens`` and
        ``plan`` (serving arguments; a slab is updated in place on one device).

    Returns:
        ``(o, state)``: this rank's outputs ``[B, T_r, Ho, V]`` (v's dtype) and the final
        states of all N sequences, ``[N, Hv, K, V]`` (or V-major), on every rank
        (initial_state's dtype, float32 without one).

    Gradients: differentiable like `linear_attention` (the all-gather is torch's
    differentiable one; every rank must run the backward). A rank's gradients of its
    slices are those of the sum of all ranks' losses; the gradients of what every
    rank holds (``initial_state``, ``A_log``, ``dt_bias``) are per-rank shares whose
    sum over the ranks is the gradient: all-reduce them as context-parallel training
    does its parameters'.

    Raises `deltarule.ContractError` before any computation, on every rank when any
    rank's arguments are invalid or when the ranks disagree on an argument that must be
    the same on every rank (`AGREED`: the shapes but T, dtypes, gate forms, scalars,
    ``cu_seqlens``, ``A_log`` / ``dt_bias`` / ``initial_state`` values; the error names the
    argument and the ranks), so that no rank waits in a collective or aborts in one.

    Example (``torchrun --nproc-per-node 2 examples/context_parallel.py``)::

        dist.init_process_group("gloo")
        o, state = deltarule.distributed.linear_attention(q_r, k_r, v_r, g=g_r, beta=beta_r)
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ContractError("group", "an initialized torch.distributed process group", "not initialized")
    group = group if group is not None else dist.group.WORLD
    gates = dict(g=g, gk=gk, beta=beta, erase=erase, write=write)
    common = dict(rule=rule, scale=scale, qk_l2norm=qk_l2norm, l2norm_eps=l2norm_eps, A_log=A_log,
                  dt_bias=dt_bias, beta_sigmoid=beta_sigmoid, chunk_size=chunk_size, backend=backend)
    failure, cu = _check_local(q, k, v, gates, common, initial_state, state_layout, cu_seqlens)
    differentiable = failure is None and torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad
        for x in (q, k, v, *gates.values(), initial_state, A_log, dt_bias))
    # One small collective of a fixed size carries every rank's token count, whether its
    # arguments passed, whether it needs gradients (then every rank takes part in the
    # backward's collective) and a digest of every argument the ranks must agree on: every
    # rank raises the same error before any collective whose size depends on the arguments.
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    if failure is None:
        head = torch.tensor([q.shape[1], 0, differentiable], dtype=torch.int64, device=device)
        mine = torch.cat([head, _digest(q, k, v, gates, common, initial_state, state_layout, cu)])
    else:                                                    # a refused q may have no token axis
        mine = torch.zeros(3 + len(AGREED), dtype=torch.int64, device=device)
        mine[1] = 1
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    heads = torch.stack(everyone).tolist()                  # one read to the host
    lengths = [x[0] for x in heads]
    refused = [r for r, x in enumerate(heads) if x[1]]
    differentiable = any(x[2] for x in heads)
    if failure is not None:
        raise failure
    if refused:
        raise ContractError("group", "valid arguments on every rank", f"rank(s) {refused} refused theirs")
    disagreement = _disagreement([x[3:] for x in heads])
    if disagreement is not None:
        raise disagreement
    if cu is not None and cu[-1] != sum(lengths):
        raise ContractError("cu_seqlens", f"ending at the ranks' total token count {sum(lengths)} "
                            f"(slices of {lengths})", cu[-1])
    B, Hv, K, V = q.shape[0], v.shape[2], k.shape[3], v.shape[3]
    N = B if cu is None else len(cu) - 1
    h0 = None
    if initial_state is not None:
        h0 = (initial_state.transpose(-1, -2) if state_layout == "vk" else initial_state).float()
    rank = dist.get_rank(group)
    table = pieces(lengths, cu, B)
    local = _Slice(q, k, v, gates, common, h0, table[rank], cu is None)
    packet = local.packet(max(packet_size(held, Hv, K, V) for held in table))
    gathered = _all_gather(packet, group, differentiable)
    incoming, finals = _chain(table, gathered, rank, h0, N, Hv, K, V, q.device)
    o = local.outputs(incoming)
    if initial_state is not None:
        finals = finals.to(initial_state.dtype)
    if state_layout == "vk":
        finals = finals.transpose(-1, -2).contiguous()
    return o, finals


def _check_local(q, k, v, gates, common, initial_state, state_layout, cu_seqlens
                 ) -> tuple[ContractError | None, list[int] | None]:
    """This rank's argument errors, as `linear_attention` would raise them (None: valid), and
    the offsets of `cu_seqlens` read to the host (None without it or when invalid)."""
    cu = None
    try:
        kernel_args = {n: x for n, x in common.items() if n != "backend"}
        api.validate(q, k, v, **gates, **kernel_args)
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                raise ContractError("q", "B = 1 with cu_seqlens (packed sequences)", tuple(q.shape))
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                    or cu_seqlens.is_floating_point():
                raise ContractError("cu_seqlens", "a 1-D integer tensor [N + 1]",
                                    getattr(cu_seqlens, "shape", type(cu_seqlens).__name__))
            cu = [int(x) for x in cu_seqlens.tolist()]
            if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise ContractError("cu_seqlens", "non-decreasing offsets from 0", cu if len(cu) < 16 else "...")
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if state_layout not in ("kv", "vk"):
            raise ContractError("state_layout", "'kv' or 'vk'", repr(state_layout))
        if initial_state is not None:
            Hv, K, V = v.shape[2], k.shape[3], v.shape[3]
            shape = (N, Hv, K, V) if state_layout == "kv" else (N, Hv, V, K)
            if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != shape:
                raise ContractError("initial_state", f"{list(shape)} ({state_layout} layout)",
                                    tuple(getattr(initial_state, "shape", ())))
            if initial_state.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ContractError("initial_state", "dtype float32, float16 or bfloat16", initial_state.dtype)
            if initial_state.device != q.device:
                raise ContractError("initial_state", f"on q's device {q.device}", initial_state.device)
    except ContractError as error:
        return error, None
    return None, cu


# The arguments every rank must pass alike, in the order a difference is reported (the first
# that differs names the error: a different Hv shows in v, then in g, beta, ...), and what of
# each must agree. Left out: the token axis T_r, the device (its index differs between ranks;
# the hashes do not depend on it), and `chunk_size` and `backend`: they choose how a rank
# computes its slice, not what (the results agree to rounding), and a rank may pick its own.
AGREED = (
    ("q", "shape (all but T) and dtype"),
    ("k", "shape (all but T) and dtype"),
    ("v", "shape (all but T) and dtype"),
    ("g", "presence, shape (all but T) and dtype"),
    ("gk", "presence, shape (all but T) and dtype"),
    ("beta", "presence, shape (all but T) and dtype"),
    ("erase", "presence, shape (all but T) and dtype"),
    ("write", "presence, shape (all but T) and dtype"),
    ("rule", "value"),
    ("scale", "value (None means K ** -0.5)"),
    ("qk_l2norm", "value"),
    ("l2norm_eps", "value"),
    ("beta_sigmoid", "value"),
    ("state_layout", "value"),
    ("A_log", "presence, shape, dtype and values"),
    ("dt_bias", "presence, shape, dtype and values"),
    ("cu_seqlens", "presence and values (the global offsets)"),
    ("initial_state", "presence, shape, dtype and values"),
)


def _digest(q, k, v, gates, common, initial_state, state_layout, cu) -> torch.Tensor:
    """``[len(AGREED)]`` int64 on q's device: a 64-bit hash of each agreed argument (of a rank
    whose arguments are valid).

    Descriptions (shapes but T, dtypes, presence, the scalars, the offsets) are hashed on the
    host: blake2b of their repr, exact (floats by ``float.hex``) and the same in every process
    (Python's ``hash`` of a str is salted per process). Tensor values: `_value_hash`."""
    def meta(x, token_axis=False):
        if x is None:
            return None
        shape = list(x.shape)
        if token_axis:
            del shape[1]
        return tuple(shape), str(x.dtype)

    scale = common["scale"] if common["scale"] is not None else k.shape[3] ** -0.5
    described = dict(q=meta(q, True), k=meta(k, True), v=meta(v, True),
                     **{n: meta(x, True) for n, x in gates.items()},
                     rule=common["rule"], scale=float(scale).hex(), qk_l2norm=bool(common["qk_l2norm"]),
                     l2norm_eps=float(common["l2norm_eps"]).hex(), beta_sigmoid=bool(common["beta_sigmoid"]),
                     state_layout=state_layout, A_log=meta(common["A_log"]), dt_bias=meta(common["dt_bias"]),
                     cu_seqlens=cu, initial_state=meta(initial_state))
    on_device = {}
    for name, x in (("A_log", common["A_log"]), ("dt_bias", common["dt_bias"]), ("initial_state", initial_state)):
        if x is not None:
            h = _value_hash(x)
            if isinstance(h, int):
                described[name] = (described[name], h)
            else:
                on_device[name] = h
    digest = torch.tensor([_host_hash(repr(described[name])) for name, _ in AGREED], dtype=torch.int64,
                          device=q.device)
    for i, (name, _) in enumerate(AGREED):
        if name in on_device:
            digest[i] ^= on_device[name].to(q.device)
    return digest


def _host_hash(data: str | bytes) -> int:
    """A signed 64-bit hash of `data`, the same in every process (blake2b)."""
    if isinstance(data, str):
        data = data.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _disagreement(digests: list[list[int]]) -> ContractError | None:
    """The error every rank raises when the ranks' digests differ (None: they agree): it names
    the first argument (in `AGREED`'s order) that differs and groups the ranks by its value."""
    differing = [i for i in range(len(AGREED)) if len({d[i] for d in digests}) > 1]
    if not differing:
        return None
    name, what = AGREED[differing[0]]
    groups: dict[int, list[int]] = {}
    for rank, d in enumerate(digests):
        groups.setdefault(d[differing[0]], []).append(rank)
    majority = max(groups.values(), key=len)              # ties: the group of rank 0 (the first)

    def ranks(rs):
        return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))

    actual = "; ".join(f"{ranks(rs)} {'differs' if len(rs) == 1 else 'differ'} from {ranks(majority)}"
                       for rs in groups.values() if rs is not majority)
    also = [AGREED[i][0] for i in differing[1:]]
    if also:
        actual += f" (also differing: {', '.join(also)})"
    return ContractError(name, f"the same {what} on every rank", actual)


_WORDS = 1 << 16               # words per chunk of `tensor_hash`
_hash_weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _weights(count: int, tag: bytes, typecode: str) -> torch.Tensor:
    """The first `count` of a fixed sequence of odd integers (int32 for typecode "i", int64 for
    "q"), the same in every process (shake_256's output; a longer one extends a shorter one)."""
    values = array.array(typecode, hashlib.shake_256(b"deltarule.distributed " + tag).digest(
        count * array.array(typecode).itemsize))
    if sys.byteorder == "big":
        values.byteswap()
    return torch.tensor(values, dtype=torch.int32 if typecode == "i" else torch.int64) | 1


def _hash_weights_on(device: torch.device, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor_hash`'s word weights ``[2, 2^16]`` and at least `chunks` chunk weights, kept per device."""
    kept = _hash_weights.get(device)
    if kept is None or kept[1].numel() < chunks:
        words = kept[0] if kept else _weights(2 * _WORDS, b"words", "i").view(2, _WORDS).to(device)
        kept = _hash_weights[device] = words, _weights(max(chunks, 64), b"chunks", "q").to(device)
    return kept


def tensor_hash(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of x's values (its bits in logical order), a 0-d int64 tensor on x's device.

    Torch ops on x's device: no copy to the host, no synchronization. x's bits are read as
    integer words ``w_i`` (int16 for 16-bit dtypes, int32 for 32-bit, two int32 per 64-bit
    element); each chunk c of 2^16 words gives two 32-bit sums ``l_c, h_c = sum_i w_i a_i,
    sum_i w_i a'_i (mod 2^32)``, joined into ``s_c = h_c 2^32 + l_c``, and the hash is
    ``sum_c s_c b_c (mod 2^64)``, with fixed odd weights ``a, a'`` (int32) and ``b`` (int64)
    drawn from shake_256. Integer arithmetic wraps and is exact, so the result depends neither
    on the order of the reduction nor on the device. A change of one element is detected for
    certain for 8-, 16- and 32-bit dtypes (a nonzero difference times an odd weight is
    nonzero modulo a power of two); changes of several elements (or both words of a 64-bit
    one) cancel only by chance (~2^-64 for unstructured ones). Shapes and dtypes are not in
    it (the caller hashes them). Cost: two multiplies and two sums per word, through a
    reused buffer of 4 chunks on the CPU (1 MiB: it stays in cache).
    """
    flat = x.detach().contiguous().view(-1)
    words = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[flat.element_size()])
    device = words.device
    full, tail = divmod(words.numel(), _WORDS)
    weights, chunk_weights = _hash_weights_on(device, full + 1)
    sums = torch.empty(2, full + 1, dtype=torch.int32, device=device)
    if full:
        rows = words[:full * _WORDS].view(full, _WORDS)
        step = 4 if device.type == "cpu" else 128             # chunks per step (GPU: fewer launches)
        products = torch.empty(min(full, step), _WORDS, dtype=torch.int32, device=device)
        wide = None if words.dtype == torch.int32 else torch.empty_like(products)
        for lo in range(0, full, step):
            block = rows[lo:lo + step]
            n = block.shape[0]
            if wide is not None:
                block = wide[:n].copy_(block)                   # sign-extended: one-to-one
            for j in (0, 1):                                     # int32 products and sums wrap (mod 2^32)
                torch.mul(block, weights[j], out=products[:n])
                torch.sum(products[:n], 1, dtype=torch.int32, out=sums[j, lo:lo + n])
    sums[:, full] = (words[full * _WORDS:].to(torch.int32) * weights[:, :tail]).sum(1, dtype=torch.int32)
    low, high = sums.long()
    chunk = high * (1 << 32) + (low & 0xFFFFFFFF)             # one-to-one from the two 32-bit sums
    return (chunk * chunk_weights[:full + 1]).sum()


_HOST_HASHED_BYTES = 1 << 16


def _value_hash(x: torch.Tensor) -> torch.Tensor | int:
    """x's values hashed: up to 64 KiB blake2b of its bytes on the host (a few microseconds;
    on a GPU a small copy that synchronizes), larger ones `tensor_hash` on x's device (a dozen
    torch calls of fixed cost, then ~1-2 GB/s per CPU thread here). The choice depends on the
    size only, which the caller's hash of the shape and dtype already compares across ranks."""
    if x.numel() * x.element_size() > _HOST_HASHED_BYTES:
        return tensor_hash(x)
    flat = x.detach().contiguous().view(-1)
    words = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    host = words.cpu().numpy()
    return _host_hash(host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes())


class _Slice:
    """This rank's tokens: the pieces that start their sequence run now from their initial
    state; a continued piece (at most one packed, every row padded) runs with the
    identity columns and is finished once its incoming state is known."""

    def __init__(self, q, k, v, gates, common, h0, held: list[Piece], padded: bool):
        self.q, self.k, self.v, self.gates, self.common = q, k, v, gates, common
        self.held = held
        continued = [p for p in held if p.continued]
        # tokens [0, split) belong to the continued piece(s), [split, T_r) to pieces starting here
        self.split = continued[0].end if continued else 0
        self.continued, self.fresh = continued, [p for p in held if not p.continued]
        self.padded = padded
        self.fresh_out = self.fresh_final = None
        if self.fresh:
            self.fresh_out, self.fresh_final = self._fresh(h0)
        self.aug_out = self.aug_final = None
        if continued:
            self.aug_out, self.aug_final = self._augmented()

    def _tokens(self, lo, hi):
        cut = lambda x: None if x is None else x[:, lo:hi]  # noqa: E731
        return cut(self.q), cut(self.k), cut(self.v), {n: cut(x) for n, x in self.gates.items()}

    def _fresh(self, h0):
        q, k, v, gates = self._tokens(self.split, self.q.shape[1])
        rows = [p.sequence for p in self.fresh]
        init = None if h0 is None else h0[rows]
        cu = None
        if not self.padded:
            cu = torch.tensor([0, *torch.tensor([p.end - p.start for p in self.fresh]).cumsum(0).tolist()],
                              dtype=torch.int64, device=q.device)
        return api.linear_attention(q, k, v, **gates, **self.common, initial_state=init, cu_seqlens=cu)

    def _augmented(self):
        q, k, v, gates = self._tokens(0, self.split)
        B, T, Hv, V = v.shape
        K = k.shape[3]
        v_aug = torch.cat([v.new_zeros(B, T, Hv, K), v], dim=-1)
        if gates["write"] is not None:
            gates = dict(gates, write=torch.cat([gates["write"].new_ones(B, T, Hv, K), gates["write"]], dim=-1))
        start = torch.zeros(B, Hv, K, K + V, device=q.device)
        start[..., :K] = torch.eye(K, device=q.device)
        return api.linear_attention(q, k, v_aug, **gates, **self.common, initial_state=start)

    def packet(self, size: int) -> torch.Tensor:
        """This rank's part of the exchange, flat float32 of `size` (`packet_size`'s maximum):
        the M of each continued piece, then the X of every held piece in order (for a piece
        that starts its sequence, the state after it), zero-padded."""
        blocks = [self.aug_final[i][..., :self.k.shape[3]] for i in range(len(self.continued))]
        for piece in self.held:
            if piece.continued:
                blocks.append(self.aug_final[self.continued.index(piece)][..., self.k.shape[3]:])
            else:
                blocks.append(self.fresh_final[self.fresh.index(piece)])
        flat = [b.reshape(-1) for b in blocks]
        used = sum(f.numel() for f in flat)
        flat.append(torch.zeros(size - used, device=self.q.device))
        return torch.cat(flat)

    def outputs(self, incoming: torch.Tensor | None) -> torch.Tensor:
        """``[B, T_r, Ho, V]``: the continued piece's outputs corrected by its incoming state."""
        B, T, Hv, V = self.v.shape
        K = self.k.shape[3]
        Ho = max(self.q.shape[2], Hv)
        parts = []
        if self.continued:
            o_aug = self.aug_out
            read, o0 = o_aug[..., :K], o_aug[..., K:]
            S = incoming.repeat_interleave(Ho // Hv, dim=1) if Ho != Hv else incoming   # [B', Ho, K, V]
            o = o0.float().clone()
            read = read.float()
            # one strided GEMM per row and head (1.4x faster here than einsum's permuted copies)
            for b in range(o.shape[0]):
                for h in range(Ho):
                    o[b, :, h].addmm_(read[b, :, h], S[b, h])
            parts.append(o.to(self.v.dtype))
        if self.fresh:
            parts.append(self.fresh_out)
        if not parts:
            return self.v.new_zeros(B, T, Ho, V)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _all_gather(packet: torch.Tensor, group, differentiable: bool) -> list[torch.Tensor]:
    """Every rank's packet; differentiable when some rank needs gradients (a rank whose
    packet depends on nothing differentiable, one without tokens say, still takes part
    in the backward's all-reduce)."""
    if differentiable:
        if not packet.requires_grad:
            packet = packet.detach().requires_grad_(True)
        return list(_AllGather.apply(packet, group))
    out = [torch.empty_like(packet) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, packet.contiguous(), group=group)
    return out


class _AllGather(torch.autograd.Function):
    """all_gather whose backward sums, over the ranks, each one's gradient of this rank's packet.

    The backward all-reduces the stacked gradients of all packets and keeps this rank's
    (one collective every backend has; the packets are small).
    """

    @staticmethod
    def forward(ctx, packet, group):
        ctx.group = group
        out = [torch.empty_like(packet) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, packet.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack([torch.zeros_like(grads[0]) if g is None else g for g in grads]).contiguous()
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def packet_size(held: list[Piece], Hv: int, K: int, V: int) -> int:
    """Floats in a rank's packet: ``Hv * K * K`` per continued piece, ``Hv * K * V`` per piece."""
    return Hv * K * (K * sum(p.continued for p in held) + V * len(held))


def _chain(table, gathered, rank, h0, N, Hv, K, V, device):
    """Walk each sequence's pieces in rank order: this rank's incoming states and every final state."""
    by_sequence: list[list[tuple[torch.Tensor | None, torch.Tensor, int]]] = [[] for _ in range(N)]
    for r, held in enumerate(table):
        continued = sum(p.continued for p in held)
        ms = gathered[r][:continued * Hv * K * K].view(continued, Hv, K, K)
        xs = gathered[r][continued * Hv * K * K:][:len(held) * Hv * K * V].view(len(held), Hv, K, V)
        m = iter(ms)
        for i, piece in enumerate(held):
            by_sequence[piece.sequence].append((next(m) if piece.continued else None, xs[i], r))
    finals, incoming = [], []
    for s in range(N):
        S = h0[s] if h0 is not None else torch.zeros(Hv, K, V, device=device)
        for M, X, r in by_sequence[s]:
            if M is None:
                S = X                                # its run started from the sequence's initial state
                continue
            if r == rank:
                incoming.append(S)
            S = torch.einsum("hij,hjv->hiv", M, S) + X
        finals.append(S)
    return (torch.stack(incoming) if incoming else None), torch.stack(finals)


# the serving arguments are not accepted (a slab is updated in place on one device), nor a
# compact capture (a verify step is a few tokens: nothing to split across ranks)
arguments.check_signature(linear_attention, without=("seq_lens", "state_indices", "num_accepted_tokens", "plan",
                                                     "capture"),
                          extra=("group",))

"""The batch plan: the validated layout of a call's sequences, built once and consumed by every backend.

A `BatchPlan` says, for a batch of `B` rows of `T` tokens, which tokens form
each sequence, which state row a sequence starts from, where its final state
and (speculative decoding) the state after each of its tokens are stored, and
which sequence owns each output token. `linear_attention` builds one from
`cu_seqlens` / `seq_lens` / `state_indices` / `num_accepted_tokens`, or takes
one the caller built with `plan_batch`: every layer of a decode step shares
the step's lengths and slab rows, so a 48-layer step can validate its indices
(and read them to the host) once instead of 48 times.

Backends read the plan and never re-derive it: host-side spans, the output
owner table, the per-token write rows, and device copies of the tables their
kernels take (`BatchPlan.cached`, built on first use and kept with the plan).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .errors import ContractError

INDEX_DTYPES = (torch.int32, torch.int64)


class Span(NamedTuple):
    """One sequence: tokens `start:end` of batch row `row` (a named tuple: a plan builds one
    per sequence on every call that brings its own indices).

    `read` is the state row it starts from: a slab row with `state_indices`,
    else the sequence's own index into `initial_state`; `read < 0` marks a
    padding sequence (zero output, no state read or written). `final` is the
    row its final state is stored into (a slab row, or its index in the
    returned state), -1 for none (padding; speculative decoding, where
    `BatchPlan.token_rows` says where each token's state goes instead).
    """

    row: int
    start: int
    end: int
    read: int
    final: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def live(self) -> bool:
        return self.read >= 0


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """The validated batch layout of `linear_attention` calls with `B` rows of `T` tokens.

    Build it with `deltarule.plan_batch` (or let `linear_attention` build it)
    and pass it as `plan=`; it replaces `cu_seqlens`, `seq_lens`,
    `state_indices` and `num_accepted_tokens`, and a call whose tensors do not
    match it (other B or T, another device, a slab of another size) raises
    `ContractError`. Immutable: its device tables are built once and reused.

    Attributes:
        B, T: the batch shape it was built for.
        spans: one `Span` per sequence, in sequence order (N = len(spans)).
        token_rows: None, or int64 [N, L] (speculative decoding): the slab
            row that receives the state after token t of sequence n
            (-1: not stored); entries at t >= the sequence's length and
            those of padding sequences are never used.
        num_slots: the slab's row count with `state_indices`, else None.
        varlen: built from `cu_seqlens` or `seq_lens`.
        device: where its index tensors (and the call's tensors) live.
        N, max_len: the number of sequences and the longest one's tokens.
        steps: token steps plus sequences (the work measure backends size threads by).
        dense: sequence n is batch row n, whole and live (no packing, no owner table).
    """

    B: int
    T: int
    spans: tuple[Span, ...]
    token_rows: np.ndarray | None
    num_slots: int | None
    varlen: bool
    device: torch.device
    # derived once at construction (every call of a reused plan reads them)
    N: int = field(init=False)
    max_len: int = field(init=False)
    steps: int = field(init=False)
    dense: bool = field(init=False)
    # what the plan was built from: (cu_seqlens, seq_lens, state_indices, num_accepted_tokens),
    # host int64 copies, None where not given (`build`): how a traced call passes the plan to
    # the ops (deltarule.custom_ops), which find or rebuild it by these values
    indices: tuple = field(default=(None, None, None, None), repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self):
        lengths = [s.end - s.start for s in self.spans]
        set_ = functools.partial(object.__setattr__, self)
        set_("N", len(self.spans))                       # also the returned state's rows without a slab
        set_("max_len", max(lengths, default=0))
        # token steps plus sequences (each reads and writes a state once): the work measure
        # backends size their threads by
        set_("steps", sum(lengths) + len(lengths))
        # sequence n is batch row n, whole and live: no packing, no owner table
        set_("dense", not self.varlen and all(s.read >= 0 for s in self.spans))

    @property
    def in_place(self) -> bool:
        """`initial_state` is a slab updated in place."""
        return self.num_slots is not None

    @property
    def speculative(self) -> bool:
        """Per-token state rows (2-D `state_indices`)."""
        return self.token_rows is not None

    def verify(self) -> "BatchPlan":
        """This slab plan as a verify step (a call with a compact `capture`): each sequence
        reads its row and stores nothing (every `final` and per-token row -1), so the rows
        keep the state the accepted transitions are replayed onto (`deltarule.replay`)."""
        def build():
            spans = tuple(s._replace(final=-1) for s in self.spans)
            rows = np.full((self.N, max(self.max_len, 1)), -1, dtype=np.int64)
            rows.flags.writeable = False
            return BatchPlan(self.B, self.T, spans, rows, self.num_slots, self.varlen, self.device,
                             indices=self.indices)
        return self.cached("verify", build)

    def cached(self, key, build):
        """`build()` on first use for `key`, then the same object: the device tables a
        backend derives from the plan (kept with the plan, so a reused plan reuses them)."""
        try:
            return self._cache[key]
        except KeyError:
            pass
        value = build()
        with self._lock:
            return self._cache.setdefault(key, value)

    def owner(self) -> np.ndarray:
        """int32 [B * T]: the sequence whose output each token keeps (-1: a zero output).

        Where clamped `cu_seqlens` spans overlap, the later sequence owns the
        token; padding sequences own nothing.
        """
        def build():
            owner = np.full(self.B * self.T, -1, dtype=np.int32)
            for n, s in enumerate(self.spans):
                if s.live:
                    owner[s.row * self.T + s.start: s.row * self.T + s.end] = n
            return owner
        return self.cached("owner", build)

    def covered(self) -> bool:
        """Every output token is owned by a live sequence."""
        return self.dense or bool((self.owner() >= 0).all())

    def overlapping(self) -> bool:
        """Two live sequences share output tokens (clamped, decreasing `cu_seqlens`)."""
        def build():
            busy = sorted((s.row * self.T + s.start, s.row * self.T + s.end)
                          for s in self.spans if s.live and s.length)
            return any(b0 < a1 for (_, a1), (b0, _) in zip(busy, busy[1:]))
        return self.cached("overlapping", build)

    def token_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequence, token, slab row) int64 arrays, one entry per per-token state store
        of a live sequence, in sequence then token order; empty without `token_rows`."""
        def build():
            n_, t_, r_ = [], [], []
            if self.token_rows is not None:
                for n, s in enumerate(self.spans):
                    if s.live:
                        for t in range(s.length):
                            row = int(self.token_rows[n, t])
                            if row >= 0:
                                n_.append(n)
                                t_.append(t)
                                r_.append(row)
            return tuple(np.asarray(x, dtype=np.int64) for x in (n_, t_, r_))
        return self.cached("token_writes", build)

    def final_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """(sequence, row) int64 arrays: the final-state stores, one per live sequence
        whose `final` row is set, in sequence order."""
        def build():
            kept = [(n, s.final) for n, s in enumerate(self.spans) if s.live and s.final >= 0]
            return tuple(np.asarray(x, dtype=np.int64) for x in (zip(*kept) if kept else ((), ())))
        return self.cached("final_writes", build)

    def store(self, slab: torch.Tensor, finals: torch.Tensor | None, token_states: torch.Tensor | None) -> None:
        """Write a slab call's results into `slab` [S, Hv, ...] in place: `finals` [N, Hv, ...]
        (one per sequence) go to the final rows, `token_states` [W, Hv, ...] (one per entry
        of `token_writes`, in that order) to the per-token rows; rows not named are not
        touched. Values are cast to the slab's dtype (rounding to nearest even)."""
        sequences, rows = self.final_writes()
        if finals is not None and len(rows):
            picked = finals.index_select(0, self._on(finals.device, "final sequences", sequences))
            slab.index_copy_(0, self._on(slab.device, "final rows", rows), picked.to(slab.device, slab.dtype))
        rows = self.token_writes()[2]
        if token_states is not None and len(rows):
            slab.index_copy_(0, self._on(slab.device, "token rows", rows), token_states.to(slab.device, slab.dtype))

    def _on(self, device: torch.device, name: str, index: np.ndarray) -> torch.Tensor:
        """An index array of the plan as a tensor on `device`, made once."""
        return self.cached((name, device), lambda: torch.from_numpy(index).to(device))

    def check_call(self, *, B: int, T: int, device: torch.device, num_slots: int | None) -> None:
        """Refuse tensors of another batch layout than the plan's (ContractError)."""
        if (B, T) != (self.B, self.T):
            raise ContractError("plan", f"q's [B, T] = [{B}, {T}] (the plan was built for those)",
                                f"a plan for [B, T] = [{self.B}, {self.T}]")
        if device != self.device:
            raise ContractError("plan", f"q's device {device}", f"a plan on {self.device}")
        if num_slots != self.num_slots:
            expected = "a plan without state_indices" if num_slots is None else f"a plan for a {num_slots}-row slab"
            actual = "a plan without state_indices" if self.num_slots is None else \
                f"a plan for a {self.num_slots}-row slab"
            raise ContractError("plan", expected + " (initial_state's rows)", actual)


def plan_batch(
    B: int,
    T: int,
    *,
    cu_seqlens: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    num_slots: int | None = None,
    device: str | torch.device | None = None,
) -> BatchPlan:
    """Validate a batch layout once; pass the result as `linear_attention(..., plan=...)`.

    The index arguments mean what they mean in `linear_attention` (see its
    docstring and docs/design.md); the plan reads them to the host now, so a
    caller that reuses it for every layer of a decode step pays the
    validation and the device-to-host reads once.

    Args:
        B, T: q's first two sizes ([B, T, Hq, K]).
        cu_seqlens: [N + 1] int32 / int64 packed offsets (needs B == 1).
        seq_lens: [B] int32 / int64 ragged lengths.
        state_indices: [N] or [N, L] int32 / int64 slab rows (needs `num_slots`).
        num_accepted_tokens: [N] int32 / int64 in [1, L] (needs 2-D state_indices).
        num_slots: the slab's row count, initial_state.shape[0]; exactly with
            state_indices.
        device: the device of the call's tensors; default: the index tensors'
            device, else the CPU.

    Returns:
        The `BatchPlan`; immutable, reusable for every call of that layout.

    Raises:
        ContractError: an invalid index argument, before any work.

    Example:
        >>> import torch, deltarule
        >>> slab = torch.zeros(6, 2, 8, 8)
        >>> plan = deltarule.plan_batch(2, 1, state_indices=torch.tensor([4, 1]), num_slots=6)
        >>> q, k, v = (torch.randn(2, 1, 2, 8) for _ in range(3))
        >>> g, beta = -torch.rand(2, 1, 2), torch.rand(2, 1, 2)
        >>> for layer in range(3):   # every layer of the step reuses the plan
        ...     o, state = deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab, plan=plan)
        >>> state is slab, plan.N
        (True, 2)
    """
    for name, x in (("B", B), ("T", T)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ContractError(name, "an int >= 0", repr(x))
    if state_indices is not None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ContractError("num_slots", "the slab's row count (an int >= 0) with state_indices",
                                repr(num_slots))
    elif num_slots is not None:
        raise ContractError("num_slots", "None without state_indices", repr(num_slots))
    if device is None:
        given = [x for x in (cu_seqlens, seq_lens, state_indices, num_accepted_tokens)
                 if isinstance(x, torch.Tensor)]
        device = given[0].device if given else torch.device("cpu")
    return build(B, T, torch.device(device), cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                 state_indices=state_indices, num_accepted_tokens=num_accepted_tokens, num_slots=num_slots)


def build(B, T, device, *, cu_seqlens, seq_lens, state_indices, num_accepted_tokens, num_slots) -> BatchPlan:
    """The plan of validated sizes B, T on `device`; `num_slots` is the slab's rows with
    state_indices (checked by the caller). Raises ContractError naming the index argument."""
    plan = _build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens, state_indices=state_indices,
                  num_accepted_tokens=num_accepted_tokens, num_slots=num_slots)
    given = (cu_seqlens, seq_lens, state_indices, num_accepted_tokens)
    if any(x is not None for x in given):           # (read to the host already: no further sync)
        object.__setattr__(plan, "indices", tuple(None if x is None else x.to("cpu", torch.int64, copy=True)
                                                  for x in given))
    return plan


def _build(B, T, device, *, cu_seqlens, seq_lens, state_indices, num_accepted_tokens, num_slots) -> BatchPlan:
    if cu_seqlens is None and seq_lens is None and state_indices is None:
        if num_accepted_tokens is not None:
            raise ContractError("num_accepted_tokens", "None without 2-D state_indices [N, L]", "a tensor")
        return dense(B, T, device)
    if cu_seqlens is not None and seq_lens is not None:
        raise ContractError("seq_lens", "None when cu_seqlens is given", "both given")
    ranges = _sequence_ranges(B, T, cu_seqlens, seq_lens, device)
    N = len(ranges)
    varlen = cu_seqlens is not None or seq_lens is not None
    if state_indices is None:
        if num_accepted_tokens is not None:
            raise ContractError("num_accepted_tokens", "None without 2-D state_indices [N, L]", "a tensor")
        spans = tuple(Span(r, s, e, n, n) for n, (r, s, e) in enumerate(ranges))
        return BatchPlan(B, T, spans, None, None, varlen, device)
    rows = _host_ints("state_indices", state_indices, device, ranks=(1, 2), length=N)
    if state_indices.dim() == 1:
        if num_accepted_tokens is not None:
            raise ContractError("num_accepted_tokens", "None without 2-D state_indices [N, L]",
                                "1-D state_indices")
        _check_rows(rows, num_slots, lambda n: f"state_indices[{n}]")
        seen = set()
        for n, r in enumerate(rows):
            if r >= 0:
                if r in seen:
                    raise ContractError(f"state_indices[{n}]", "distinct slab rows", f"{r} repeated")
                seen.add(r)
        spans = tuple(Span(b, s, e if r >= 0 else s, r, r) for (b, s, e), r in zip(ranges, rows))
        return BatchPlan(B, T, spans, None, num_slots, varlen, device)
    return _speculative(B, T, device, ranges, rows, state_indices.shape[1], num_accepted_tokens,
                        num_slots, varlen)


def _speculative(B, T, device, ranges, rows, L, num_accepted_tokens, num_slots, varlen) -> BatchPlan:
    """Plan of 2-D state_indices [N, L]: read from column accepted - 1, token t writes column t."""
    N = len(ranges)
    if L < 1:
        raise ContractError("state_indices", "[N, L] with L >= 1", f"shape [{N}, {L}]")
    for n, r in enumerate(rows):
        _check_rows(r, num_slots, lambda t, n=n: f"state_indices[{n}, {t}]")
    accepted = [1] * N
    if num_accepted_tokens is not None:
        accepted = _host_ints("num_accepted_tokens", num_accepted_tokens, device, ranks=(1,), length=N)
        for n, a in enumerate(accepted):
            if not 1 <= a <= L:
                raise ContractError(f"num_accepted_tokens[{n}]", f"a count in [1, L = {L}]", a)
    spans, written = [], {}
    for n, ((b, s, e), idx, a) in enumerate(zip(ranges, rows, accepted)):
        read = idx[a - 1]
        if read < 0:                                   # padding: nothing read, written or output
            spans.append(Span(b, s, s, -1, -1))
            continue
        if e - s > L:
            raise ContractError("state_indices", "[N, L] with L >= every live sequence's length",
                                f"L = {L}, sequence {n} has {e - s} tokens")
        for t in range(e - s):
            r = idx[t]
            if r >= 0:
                if r in written:
                    raise ContractError(f"state_indices[{n}, {t}]", "distinct slab rows among the rows "
                                        "live sequences write", f"{r} repeated (also {written[r][1]})")
                written[r] = (n, f"state_indices[{n}, {t}]")
        spans.append(Span(b, s, e, read, -1))
    # a sequence reading past its tokens (accepted > its length) reads a row it does not write:
    # no other sequence may write it (the kernels read each sequence's row as they reach it)
    for n, (span, a) in enumerate(zip(spans, accepted)):
        other = written.get(span.read)
        if span.read >= 0 and other is not None and other[0] != n:
            raise ContractError(f"state_indices[{n}, {a - 1}]", "a read row no other live sequence writes",
                                f"{span.read}, written as {other[1]}")
    token_rows = np.asarray(rows, dtype=np.int64).reshape(N, L)
    token_rows.flags.writeable = False
    return BatchPlan(B, T, tuple(spans), token_rows, num_slots, varlen, device)


@functools.lru_cache(maxsize=64)
def dense(B: int, T: int, device: torch.device) -> BatchPlan:
    """Sequence b is row b: the plan of a call without index arguments (cached: immutable)."""
    return BatchPlan(B, T, tuple(Span(b, 0, T, b, b) for b in range(B)), None, None, False, device)


def _sequence_ranges(B, T, cu_seqlens, seq_lens, device) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence: clamped cu_seqlens (B == 1), seq_lens, or whole rows."""
    if cu_seqlens is not None:
        offsets = _host_ints("cu_seqlens", cu_seqlens, device, ranks=(1,))
        if len(offsets) < 1:
            raise ContractError("cu_seqlens", "[N + 1] offsets, N + 1 >= 1", "shape [0]")
        if B != 1:
            raise ContractError("cu_seqlens", "B == 1 (q [1, T, Hq, K]) with cu_seqlens", f"B = {B}")
        clamped = [min(max(x, 0), T) for x in offsets]
        return [(0, s, max(s, e)) for s, e in zip(clamped[:-1], clamped[1:])]
    if seq_lens is not None:
        lengths = _host_ints("seq_lens", seq_lens, device, ranks=(1,), length=B)
        for b, n in enumerate(lengths):
            if not 0 <= n <= T:
                raise ContractError(f"seq_lens[{b}]", f"a length in [0, {T}]", n)
        return [(b, 0, n) for b, n in enumerate(lengths)]
    return [(b, 0, T) for b in range(B)]


def _host_ints(name, x, device, *, ranks, length=None):
    """An integer tensor's values on the host (nested lists for rank 2), rank and length checked."""
    if not isinstance(x, torch.Tensor):
        raise ContractError(name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in INDEX_DTYPES:
        raise ContractError(name, "dtype int32 or int64", x.dtype)
    if x.dim() not in ranks or (length is not None and x.shape[0] != length):
        if length is None:
            expected = "a rank-1 tensor"
        else:
            expected = " or ".join(f"shape [{length}{', L' if r == 2 else ''}]" for r in ranks)
        raise ContractError(name, expected, f"shape {list(x.shape)}")
    if x.device != device:
        raise ContractError(name, f"device {device} (q's)", x.device)
    return x.tolist()


def _check_rows(rows, num_slots, where) -> None:
    for i, r in enumerate(rows):
        if r >= num_slots:
            raise ContractError(where(i), f"a slab row < {num_slots} (or < 0 for padding)", r)

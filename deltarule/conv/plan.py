"""A short-convolution call's layout: `ConvPlan` and `plan_conv`, which turns packed sequences'
lengths and slab rows into the gather indices and the per-sequence table of the call (a serving
step builds it once for every layer), with the integer and list checks of its arguments."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from ..errors import ContractError


@dataclass(frozen=True)
class ConvPlan:
    """One call's layout: the per-sequence table (the cpu form's) and the torch form's gather
    indices. ``src`` below is the call's gathered slab rows, [N * S, C] (zero for sequences
    without a prior), followed by its tokens, [T, C]."""

    width: int
    columns: int                 # S: slab columns gathered per sequence
    taps: torch.Tensor           # [W, T] int64 into src: tap j of token t (j = W - 1: t itself)
    write_rows: torch.Tensor     # [M] int64 slab row of each element written
    write_cols: torch.Tensor     # [M] int64 its column
    write_src: torch.Tensor      # [M] int64 into src: its new value
    tokens: int                  # T
    table: torch.Tensor          # [N, 5] int64 (start, length, read row or -1, read column, write row or -1)
    rolling: bool
    crossed: bool                # a sequence writes a slab row another sequence reads
    read_rows: tuple[int, ...] = ()    # plan_conv's rows as given (fresh ones included)
    write_rows_given: tuple[int, ...] = ()
    slots: int = 0               # the slab rows a call needs: 1 + the largest row given (read or write)

    def check_slab(self, slots: int) -> None:
        """Refuse a conv_state of `slots` rows that a row of the plan lies beyond (ContractError
        naming the row): checked per call, before any work, as the plan holds no slab."""
        if self.slots <= slots:
            return
        for name, rows in (("read_rows", self.read_rows), ("write_rows", self.write_rows_given)):
            for n, r in enumerate(rows):
                if r >= slots:
                    raise ContractError("plan", f"slab rows < {slots} (conv_state's row count; negative: "
                                        "padding)", f"{name}[{n}] = {r}")


def plan_conv(lengths: list[int], *, width: int, read_rows: list[int], write_rows: list[int],
              fresh: list[bool] | None = None, accepted: list[int] | None = None,
              columns: int | None = None) -> ConvPlan:
    """The gather indices of a call over sequences of `lengths` (packed in order).

    Args:
        lengths: [N] token counts, ints >= 0 (a sequence of 0 tokens is skipped: its output
            is empty and it writes nothing).
        width: W, the taps per channel (an int >= 1).
        read_rows / write_rows: [N] slab rows, ints (vLLM reads and writes one row per
            sequence); each must be < the slab's row count, checked per call (the plan holds
            no slab). The write rows of sequences with tokens must be distinct.
        fresh: [N] bools, True where the sequence has no prior (reads zeros); default none. A
            negative read row reads zeros too; a negative write row writes nothing (padding:
            negative rows may repeat).
        accepted: [N] accepted-token counts >= 1 of the rolling convention; None: plain.
        columns: S, the slab's columns the plan uses; default W - 1 (with `accepted`, give the
            rolling rows' W - 1 + draft tokens).

    Raises ContractError naming the argument (and the entry) for any invalid one.
    """
    N = _length("lengths", lengths)
    lengths = _ints("lengths", lengths, N, low=0)
    W = _int("width", width, low=1)
    if _length("read_rows", read_rows) != N or _length("write_rows", write_rows) != N:
        raise ContractError("read_rows / write_rows", f"{N} rows each", (len(read_rows), len(write_rows)))
    read_rows = _ints("read_rows", read_rows, N)
    write_rows = _ints("write_rows", write_rows, N)
    if fresh is not None:
        if _length("fresh", fresh) != N or not all(isinstance(f, bool) for f in fresh):
            raise ContractError("fresh", f"None or {N} bools (one per sequence)", _shown(fresh))
    S = W - 1 if columns is None else _int("columns", columns, low=0)
    if S < W - 1:
        raise ContractError("columns", f">= width - 1 = {W - 1}", S)
    if accepted is not None:
        accepted = _ints("accepted", accepted, N)
        if any(not 1 <= a <= S - W + 2 for a in accepted):
            raise ContractError("accepted", f"in [1, {S - W + 2}]", accepted)
    if accepted is not None and W < 2:
        raise ContractError("width", ">= 2 with the rolling convention", W)
    if accepted is not None and any(W - 2 + L > S for L in lengths):
        raise ContractError("lengths", f"<= {S - W + 2} (W - 2 + L within the {S} columns of a rolling row)",
                            lengths)
    # the rows written (sequences with tokens and a write row >= 0) must be distinct: two sequences
    # writing one row would race (the cpu form's tasks run in any order); negative rows are padding
    # and a sequence of 0 tokens writes nothing, as with linear_attention's per-token rows
    writer = {}
    for n, (L, r) in enumerate(zip(lengths, write_rows)):
        if L > 0 and r >= 0:
            if r in writer:
                raise ContractError(f"write_rows[{n}]", "distinct slab rows among the sequences with tokens "
                                    "(negative: padding, may repeat)", f"{r} repeated (also write_rows[{writer[r]}])")
            writer[r] = n
    live = [n for n in range(N) if lengths[n] > 0 and write_rows[n] >= 0]
    lens = torch.tensor(lengths, dtype=torch.long)
    T = int(lens.sum())
    offsets = torch.tensor(accepted, dtype=torch.long) - 1 if accepted is not None else torch.zeros(N, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(N), lens, output_size=T)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(T) - starts[seq]
    token = torch.arange(T) + N * S
    taps = torch.empty(W, T, dtype=torch.long)
    for j in range(W):
        back = pos - (W - 1) + j                                   # the input's position in its sequence
        taps[j] = torch.where(back >= 0, token - (W - 1) + j, seq * S + offsets[seq] + pos + j)
    live_t = torch.tensor(live, dtype=torch.long)
    L, first, o = lens[live_t, None], N * S + starts[live_t, None], offsets[live_t, None]
    n = live_t[:, None]
    if accepted is not None:                                       # prior's last W - 2, then the tokens
        cols = torch.arange(W - 2 + int(L.max()) if live else 0).expand(len(live), -1)
        src = torch.where(cols < W - 2, n * S + o + 1 + cols, first + cols - (W - 2))
        keep = cols < W - 2 + L
    else:                                                          # the last W - 1 of (prior, tokens)
        cols = torch.arange(W - 1).expand(len(live), -1)
        e = L + cols
        src = torch.where(e < W - 1, n * S + o + e, first + e - (W - 1))
        keep = torch.ones_like(cols, dtype=torch.bool)
    w_rows = torch.tensor(write_rows, dtype=torch.long)[live_t, None].expand_as(cols)[keep]
    reads = [-1 if f else r for f, r in zip(fresh or [False] * N, read_rows)]
    table = torch.stack((starts, lens, torch.tensor(reads, dtype=torch.long), offsets,
                         torch.tensor(write_rows, dtype=torch.long)), dim=1)
    # a row one sequence writes and another reads: the cpu form's (sequence, channel block) tasks run
    # on several threads in any order, so every prior must be gathered first (a sequence reading
    # the row it writes reads its own block before writing it)
    readers: dict[int, set[int]] = {}
    for m, r in enumerate(reads):
        if r >= 0:
            readers.setdefault(r, set()).add(m)
    crossed = any(readers.get(write_rows[n], {n}) - {n} for n in live)
    return ConvPlan(W, S, taps, w_rows, cols[keep], src[keep], T, table.contiguous(), accepted is not None, crossed,
                    tuple(read_rows), tuple(write_rows), 1 + max((*read_rows, *write_rows), default=-1))


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _shown(values):
    """A value for an error message: short sequences as a list, long ones by their length."""
    try:
        return list(values) if len(values) <= 16 else f"{type(values).__name__} of {len(values)}"
    except TypeError:
        return repr(values)


def _length(name: str, values) -> int:
    """len(values) of a list argument, or ContractError."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise ContractError(name, "a list", type(values).__name__)
    return len(values)


def _int(name: str, x, *, low: int | None = None) -> int:
    """An int argument (not a bool: True is not a width), in int64 and >= low."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not _INT64[0] <= x <= _INT64[1] \
            or (low is not None and x < low):
        raise ContractError(name, "an int" + (f" >= {low}" if low is not None else " (int64)"), repr(x))
    return int(x)


def _ints(name: str, values, n: int, *, low: int | None = None) -> list[int]:
    """A list argument of n ints (see `_int`), as a list of Python ints."""
    if _length(name, values) != n:
        raise ContractError(name, f"{n} entries (one per sequence)", _shown(values))
    out = []
    for i, x in enumerate(values):
        out.append(_int(f"{name}[{i}]", x, low=low))
    if low == 0 and sum(out) > _INT64[1]:
        raise ContractError(name, "a total within int64", sum(out))
    return out

"""Hypothesis strategies for `deltarule.linear_attention` (tests/test_properties.py).

Hypothesis draws a `Call`: the sizes, the rule and gate forms, the flags, the index
arguments (cu_seqlens, seq_lens, state_indices, num_accepted_tokens: small lists, drawn
so that they shrink well) and a seed. `make_args(call)` builds the keyword arguments of
`linear_attention` from it; tensor values come from a torch.Generator seeded by
`call.seed` (drawing them element by element would be slow and shrink nowhere useful).
A failing example prints the drawn `Call(...)` (hypothesis lists every field;
`repr` only the non-default ones): `make_args(Call(...))` rebuilds the call outside
hypothesis.

Every call `valid_calls` draws is valid: log decays <= 0 unless the raw-gate arm is on,
keys L2-normalised unless `qk_l2norm`, beta / erase / write in (0, 1) (or logits with
`beta_sigmoid`), slab rows distinct where the contract says so. Values stay well
conditioned, so a float32 backend lands within ~1e-5 of the float64 oracle.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch
from hypothesis import assume
from hypothesis import strategies as st

import deltarule

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
RULES = ("linear", "gated", "delta", "gated_delta")
GATED = ("gated", "gated_delta")
DELTA = ("delta", "gated_delta")
INDEX_ARGS = ("cu_seqlens", "seq_lens", "state_indices", "num_accepted_tokens")
# inputs that are only read: a stride-0 (expanded) view of one is a valid argument
READ_ONLY = ("q", "k", "v", "g", "gk", "beta", "erase", "write", "A_log", "dt_bias")
# log decay ranges per strength: "mild" is the realistic one (decay factors 0.14 .. 1)
DECAY_RANGE = {"mild": (-2.0, 0.0), "strong": (-30.0, -4.0), "zero": (0.0, 0.0)}


@dataclass(frozen=True)
class Call:
    """The drawn description of one valid `linear_attention` call (see `make_args`).

    `state`: None (no initial_state) or its dtype name; with `state_indices` it is a slab
    of `num_slots` rows. `state_indices` is a tuple (1-D) or a tuple of tuples ([N, L]).
    `views`: (argument, kind, dim) with kind "transposed" (dim `dim` innermost in memory),
    "strided" (every other element of a larger buffer along `dim`) or "expanded" (a
    stride-0 broadcast of index 0 along `dim`: the values change, the call stays valid).
    `decay`: "none" | "g" | "gk" | "g+gk"; `update`: "none" | "beta" | "erase_write".
    `shared`: inputs that are only read, made to share memory (valid: only a tensor the
    call writes may not overlap another): "q_is_k", "v_is_k", "write_is_erase" (one tensor
    passed twice), "state_over_q" (a non-slab initial_state and q, views of one buffer).
    """

    seed: int = 0
    dtype: str = "float32"
    B: int = 1
    T: int = 1
    Hq: int = 1
    Hk: int = 1
    Hv: int = 1
    K: int = 1
    V: int = 1
    rule: str = "gated_delta"
    decay: str = "g"
    update: str = "beta"
    raw_gate: bool = False
    beta_sigmoid: bool = False
    qk_l2norm: bool = False
    l2norm_eps: float | None = None
    gate_dtype: str = "float32"
    raw_dtype: str = "float32"
    strength: str = "mild"
    reset_rate: float = 0.0
    scale: float | None = None
    state: str | None = None
    state_layout: str = "kv"
    cu_seqlens: tuple | None = None
    seq_lens: tuple | None = None
    state_indices: tuple | None = None
    num_accepted_tokens: tuple | None = None
    num_slots: int | None = None
    L: int | None = None
    index_dtype: str = "int32"
    use_plan: bool = False
    chunk_size: int | None = None
    views: tuple = field(default=())
    shared: tuple = field(default=())

    def __repr__(self) -> str:
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Call({', '.join(changed)})"

    @property
    def slab(self) -> bool:
        return self.state_indices is not None

    @property
    def speculative(self) -> bool:
        """2-D state_indices [N, L]."""
        return self.L is not None

    @property
    def N(self) -> int:
        """Sequences: len(cu_seqlens) - 1 with varlen offsets, else B."""
        return len(self.cu_seqlens) - 1 if self.cu_seqlens is not None else self.B


# ----------------------------------------------------------------------------------------
# building the arguments


def make_args(call: Call, *, plan: bool | None = None) -> dict:
    """The keyword arguments of `linear_attention` for `call` (no `backend`), deterministic.

    With `call.use_plan` (or `plan=True`) the index arguments are replaced by a
    `deltarule.plan_batch` plan built from them; `plan=False` keeps the index arguments.
    """
    gen = torch.Generator().manual_seed(call.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def uniform(lo, hi, *shape):
        return torch.rand(*shape, generator=gen) * (hi - lo) + lo

    B, T, Hq, Hk, Hv, K, V = call.B, call.T, call.Hq, call.Hk, call.Hv, call.K, call.V
    dt, gate_dt, raw_dt = DTYPES[call.dtype], DTYPES[call.gate_dtype], DTYPES[call.raw_dtype]
    q, k, v = randn(B, T, Hq, K), randn(B, T, Hk, K), randn(B, T, Hv, V)
    if call.qk_l2norm:
        # raw rows of any magnitude: the kernel normalises them
        q, k = q * uniform(0.1, 4.0, B, T, Hq, 1), k * uniform(0.1, 4.0, B, T, Hk, 1)
    else:
        k = torch.nn.functional.normalize(k, dim=-1)    # keeps the delta rules contracting
    args = {"q": q.to(dt), "k": k.to(dt), "v": v.to(dt), "rule": call.rule}

    lo, hi = DECAY_RANGE[call.strength]
    for name, shape in (("g", (B, T, Hv)), ("gk", (B, T, Hv, K))):
        if name not in call.decay.split("+"):
            continue
        # the raw-gate arm takes a projection of any sign; a log decay is <= 0
        x = randn(*shape) * 2.0 if call.raw_gate else uniform(lo, hi, *shape)
        if call.reset_rate:
            x = x.masked_fill(torch.rand(*shape, generator=gen) < call.reset_rate, float("-inf"))
        args[name] = x.to(gate_dt)
    if call.raw_gate:
        args["A_log"] = uniform(-1.0, 1.0, Hv).to(raw_dt)
        args["dt_bias"] = uniform(-1.0, 1.0, *((Hv,) if call.decay == "g" else (Hv, K))).to(raw_dt)

    def gate(*shape):                     # in (0, 1), or logits for beta_sigmoid
        return (randn(*shape) * 2.0 if call.beta_sigmoid else uniform(0.0, 1.0, *shape)).to(gate_dt)

    if call.update == "beta":
        args["beta"] = gate(B, T, Hv)
    elif call.update == "erase_write":
        args["erase"], args["write"] = gate(B, T, Hv, K), gate(B, T, Hv, V)
    if call.beta_sigmoid:
        args["beta_sigmoid"] = True
    if call.qk_l2norm:
        args["qk_l2norm"] = True
    for name in ("l2norm_eps", "scale", "chunk_size"):
        if getattr(call, name) is not None:
            args[name] = getattr(call, name)

    if call.state is not None:
        rows = call.num_slots if call.slab else call.N
        tail = (Hv, K, V) if call.state_layout == "kv" else (Hv, V, K)
        args["initial_state"] = (randn(rows, *tail) * 0.5).to(DTYPES[call.state])
    args["state_layout"] = call.state_layout

    index = INDEX_DTYPES[call.index_dtype]
    for name in INDEX_ARGS:
        values = getattr(call, name)
        if values is None:
            continue
        x = torch.tensor(values, dtype=index)
        if name == "state_indices" and call.speculative:
            x = x.reshape(len(values), call.L)          # [0, L] too
        args[name] = x

    for name, kind, dim in call.views:
        if name in args:
            args[name] = view_of(args[name], kind, dim)
    for how in call.shared:
        share(args, how)

    if call.use_plan if plan is None else plan:
        args = with_plan(args, call)
    return args


def share(args: dict, how: str) -> None:
    """Make read-only inputs of `args` share memory (`Call.shared`), in place."""
    if how == "q_is_k":
        args["q"] = args["k"]
    elif how == "v_is_k":
        args["v"] = args["k"]
    elif how == "write_is_erase":
        args["write"] = args["erase"]
    elif how == "state_over_q":               # the state's values overwrite q's where they overlap
        q, state = args["q"], args["initial_state"]
        buffer = torch.empty(max(q.numel(), state.numel()), dtype=q.dtype)
        buffer[:q.numel()] = q.reshape(-1)
        buffer[:state.numel()] = state.reshape(-1)
        args["q"], args["initial_state"] = buffer[:q.numel()].view(q.shape), buffer[:state.numel()].view(state.shape)
    else:
        raise ValueError(how)


def sharing(call: Call) -> list[str]:
    """The `Call.shared` kinds that fit `call` (same shapes and dtypes)."""
    kinds = []
    if call.Hq == call.Hk:
        kinds.append("q_is_k")                    # q normalised like k: still well conditioned
    if call.Hv == call.Hk and call.V == call.K:
        kinds.append("v_is_k")
    if call.update == "erase_write" and call.K == call.V:
        kinds.append("write_is_erase")
    if call.state == call.dtype and not call.slab and call.B * call.T:
        kinds.append("state_over_q")
    return kinds


def with_plan(args: dict, call: Call) -> dict:
    """`args` with the index arguments replaced by `plan=deltarule.plan_batch(...)`."""
    out = {n: x for n, x in args.items() if n not in INDEX_ARGS}
    out["plan"] = deltarule.plan_batch(
        call.B, call.T, **{n: args[n] for n in INDEX_ARGS if n in args},
        num_slots=call.num_slots if call.slab else None)
    return out


def view_of(x: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """x's values (index 0 broadcast along `dim` for "expanded") in another memory layout."""
    dim %= max(x.dim(), 1)
    if kind == "expanded":
        return x.narrow(dim, 0, min(1, x.shape[dim])).expand(x.shape) if x.shape[dim] else x
    if kind == "transposed":
        inner = x.dim() - 1
        if dim == inner:                            # the last dimension outermost instead
            return x.movedim(inner, 0).contiguous().movedim(0, inner)
        return x.movedim(dim, inner).contiguous().movedim(inner, dim)
    if kind == "strided":
        shape = list(x.shape)
        shape[dim] = 2 * shape[dim] + 1
        big = torch.full(shape, 7, dtype=x.dtype)   # junk between the elements
        index = [slice(None)] * x.dim()
        index[dim] = slice(1, None, 2)
        y = big[tuple(index)]
        y.copy_(x)
        return y
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------
# strategies


def count(draw, hi: int, lo: int = 0) -> int:
    """A size in [lo, hi]: lo (0: nothing to do) about one draw in ten, and what it shrinks
    to (hypothesis's own integers favour their bounds: half the calls came out empty)."""
    if lo == hi or draw(st.sampled_from(range(10))) == 0:
        return lo
    return draw(st.integers(lo + 1, hi))


@st.composite
def valid_calls(draw, *, max_B=3, max_T=40, max_dim=24, max_heads=2, max_N=4, min_B=0, min_T=0,
                dtypes=("float32", "float32", "bfloat16", "float16"), rules=RULES, raw_gates=(False, True),
                layouts=("dense", "dense", "cu_seqlens", "seq_lens"),
                slabs=("none", "none", "slab", "speculative"), accepted=(False, True), views=True, plans=True,
                chunk_sizes=(None, None, 1, 3, 16, 64, 1000)):
    """A random valid `Call`. The defaults suit the fast backends (cpu, torch); the slow
    ones (triton and wgsl here) take smaller `max_T` / `max_dim`; the other arguments
    narrow the draw (the invalid calls need e.g. a slab, or a decay gate)."""
    dtype = draw(st.sampled_from(dtypes))
    heads = draw(st.sampled_from(["same", "gqa", "gva"]))
    h = draw(st.integers(1, max_heads))
    G = 1 if heads == "same" else draw(st.integers(2, 3))
    Hq, Hk, Hv = (h, h, h) if heads == "same" else (h * G, h, h) if heads == "gqa" else (h, h, h * G)
    K = draw(st.integers(1, max_dim))
    # K == V one call in five: a kv and a vk state look alike, v and k may be one tensor
    V = K if draw(st.sampled_from(range(5))) == 0 else draw(st.integers(1, max_dim))

    layout = draw(st.sampled_from(layouts))
    T = count(draw, max_T, min_T)
    cu_seqlens = seq_lens = None
    if layout == "cu_seqlens":
        B, N = 1, count(draw, max_N, min_B)
        if draw(st.booleans()):                   # ordinary packing, empty sequences allowed
            points = sorted(draw(st.lists(st.integers(0, T), min_size=N + 1, max_size=N + 1)))
            if draw(st.booleans()):
                points[0], points[-1] = 0, T
        else:                                     # clamped, decreasing and overlapping offsets
            points = draw(st.lists(st.integers(-3, T + 3), min_size=N + 1, max_size=N + 1))
        cu_seqlens = tuple(points)
        clamped = [min(max(x, 0), T) for x in points]
        lengths = [max(s, e) - s for s, e in itertools.pairwise(clamped)]
    elif layout == "seq_lens":
        B = count(draw, max_B, min_B)
        seq_lens = tuple(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
        lengths, N = list(seq_lens), B
    else:
        B = count(draw, max_B, min_B)
        lengths, N = [T] * B, B

    slab = draw(st.sampled_from(slabs))
    state_indices = num_accepted = num_slots = L = None
    if slab == "slab":
        padding = draw(st.lists(st.booleans(), min_size=N, max_size=N))
        num_slots = N + draw(st.integers(0, 3))
        perm = draw(st.permutations(range(num_slots)))
        negative = draw(st.sampled_from([-1, -3, -2**31]))
        state_indices = tuple(negative if pad else perm[n] for n, pad in enumerate(padding))
    elif slab == "speculative":
        state_indices, num_accepted, num_slots, L = draw(speculative_rows(lengths, accepted))

    rule = draw(st.sampled_from(rules))
    decay = draw(st.sampled_from(["g", "g", "gk", "g+gk"])) if rule in GATED else "none"
    update = draw(st.sampled_from(["beta", "beta", "erase_write"])) if rule in DELTA else "none"
    raw_gate = decay in ("g", "gk") and draw(st.sampled_from(raw_gates))
    beta_sigmoid = update != "none" and draw(st.booleans())
    qk_l2norm = draw(st.booleans())
    l2norm_eps = draw(st.sampled_from([None, None, 0.0, 1e-12, 1e-3]))
    gate_dtype = draw(st.sampled_from(["float32", dtype]))
    raw_dtype = draw(st.sampled_from(["float32", dtype])) if raw_gate else "float32"
    strength = draw(st.sampled_from(["mild", "mild", "mild", "strong", "zero"])) if decay != "none" else "mild"
    reset_rate = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])) if decay != "none" else 0.0
    # any finite real is a valid scale: negative and zero ones too
    scale = draw(st.one_of(st.none(), st.sampled_from([0.0, -1.0, 2.5]),
                           st.floats(0.05, 4.0).map(lambda x: round(x, 3))))

    in_place = state_indices is not None
    state = draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"] + ([] if in_place else [None, None])))
    state_layout = draw(st.sampled_from(["kv", "vk"]))
    index_dtype = draw(st.sampled_from(list(INDEX_DTYPES)))
    use_plan = plans and draw(st.booleans())
    chunk_size = draw(st.sampled_from(chunk_sizes))

    call = Call(seed=draw(st.integers(0, 2**32 - 1)), dtype=dtype, B=B, T=T, Hq=Hq, Hk=Hk, Hv=Hv, K=K, V=V,
                rule=rule, decay=decay, update=update, raw_gate=raw_gate, beta_sigmoid=beta_sigmoid,
                qk_l2norm=qk_l2norm, l2norm_eps=l2norm_eps, gate_dtype=gate_dtype, raw_dtype=raw_dtype,
                strength=strength, reset_rate=reset_rate, scale=scale, state=state, state_layout=state_layout,
                cu_seqlens=cu_seqlens, seq_lens=seq_lens, state_indices=state_indices,
                num_accepted_tokens=num_accepted, num_slots=num_slots, L=L, index_dtype=index_dtype,
                use_plan=use_plan, chunk_size=chunk_size)
    if views:
        call = dataclasses.replace(call, views=tuple(draw(st.lists(view_specs(call), max_size=3))))
        shared = tuple(how for how in sharing(call) if draw(st.sampled_from(range(4))) == 0)
        call = dataclasses.replace(call, shared=shared)
    return call


def tensor_ranks(call: Call) -> dict[str, int]:
    """name -> rank of every tensor argument `call` has (before any plan)."""
    ranks = {"q": 4, "k": 4, "v": 4}
    ranks.update({n: r for n, r in (("g", 3), ("gk", 4)) if n in call.decay.split("+")})
    if call.update == "beta":
        ranks["beta"] = 3
    elif call.update == "erase_write":
        ranks.update(erase=4, write=4)
    if call.raw_gate:
        ranks.update(A_log=1, dt_bias=1 if call.decay == "g" else 2)
    if call.state is not None:
        ranks["initial_state"] = 4
    for name in INDEX_ARGS:
        if getattr(call, name) is not None:
            ranks[name] = 2 if name == "state_indices" and call.speculative else 1
    return ranks


@st.composite
def view_specs(draw, call: Call):
    """(argument, kind, dim): a non-contiguous or expanded view of one of call's tensors.
    Expanded views only of read-only inputs (a non-slab initial_state is read-only too)."""
    ranks = tensor_ranks(call)
    name = draw(st.sampled_from(sorted(ranks)))
    kinds = ["transposed", "strided"]
    if name in READ_ONLY or (name == "initial_state" and not call.slab):
        kinds.append("expanded")
    return name, draw(st.sampled_from(kinds)), draw(st.integers(0, ranks[name] - 1))


@st.composite
def speculative_rows(draw, lengths: list[int], accepted_choices=(False, True)):
    """(state_indices [N][L], num_accepted_tokens or None, num_slots, L) of a valid speculative
    plan for sequences of `lengths`: distinct rows for the tokens live sequences store
    (some of them negative: not stored), the read column non-negative for live ones,
    anything in range elsewhere (never written), padding sequences (negative read row) whose
    length may exceed L."""
    N = len(lengths)
    padding = [draw(st.integers(0, 3)) == 0 for _ in range(N)]
    use_accepted = draw(st.sampled_from(accepted_choices))
    longest = max((n for n, pad in zip(lengths, padding) if not pad), default=0)
    L = draw(st.integers(max(longest, 1), max(longest, 1) + 2))
    # the read column is accepted - 1 (column 0 without num_accepted_tokens); accepted may
    # exceed the sequence's length (vLLM's ragged verify)
    accepted = [draw(st.integers(1, L)) if use_accepted else 1 for _ in lengths]
    # which columns store a state: the read column always (for live sequences)
    stores = [[not pad and t < n and (t == a - 1 or draw(st.integers(0, 3)) > 0) for t in range(L)]
              for pad, n, a in zip(padding, lengths, accepted)]
    fresh = sum(map(sum, stores))
    num_slots = fresh + draw(st.integers(0, 3))
    if any(not pad and a - 1 >= n for pad, n, a in zip(padding, lengths, accepted)):
        num_slots = max(num_slots, fresh + 1)   # a live sequence reading past its tokens reads a row
    order = draw(st.permutations(range(num_slots)))
    perm = iter(order)
    # the row a live sequence reads past its tokens: one no sequence writes
    unwritten = list(order[fresh:])
    rows = []
    for pad, n, a, store in zip(padding, lengths, accepted, stores):
        row = []
        for t in range(L):
            if store[t]:
                row.append(next(perm))
            elif t == a - 1:                # the read column: negative = padding
                row.append(-1 if pad else draw(st.sampled_from(unwritten)))
            elif not pad and t < n:         # a token that keeps no state
                row.append(draw(st.sampled_from([-1, -5])))
            else:                           # never written: negative, or any row in range
                row.append(draw(st.integers(-1, num_slots - 1)))
        rows.append(tuple(row))
    return tuple(rows), (tuple(accepted) if use_accepted else None), num_slots, L


# ----------------------------------------------------------------------------------------
# invalid calls: a valid call with one thing broken

FLOAT_DTYPES = tuple(DTYPES.values())
GATES = ("g", "gk", "beta", "erase", "write")


@dataclass(frozen=True)
class Broken:
    """One thing broken in a valid `Call`: `kind`, the argument it breaks (`target`) and a
    few drawn details (`detail`); `break_call` applies it."""

    kind: str
    target: str = ""
    detail: tuple = ()


def applicable(call: Call) -> list[str]:
    """The kinds of breakage that make `call` invalid (each is sure to)."""
    kinds = ["shape", "dtype", "scale", "l2norm_eps", "chunk_size", "rule", "state_layout", "flag",
             "device", "plan", "backend"]
    if call.state is not None and call.K != call.V:
        kinds.append("layout_swap")
    kinds.append("missing_decay" if call.rule in GATED else "extra_decay")
    kinds.append("missing_update" if call.rule in DELTA else "extra_update")
    if call.rule not in DELTA:
        kinds.append("beta_sigmoid_without_beta")
    if call.raw_gate or call.decay != "none":
        kinds.append("raw_gate_half")
    if call.decay == "g+gk":
        kinds.append("raw_gate_both")
    if call.decay == "none":
        kinds.append("raw_gate_without_decay")
    if call.decay != "none" and not call.raw_gate and call.B * call.T * call.Hv:
        kinds.append("positive_decay")
    if call.slab:
        kinds += ["row_out_of_range", "slab_without_state", "requires_grad_slab"]
        if call.num_slots >= 2 and call.Hv * call.K * call.V >= 1:
            kinds.append("slab_overlaps_itself")
        if call.num_slots * call.Hv * call.K * call.V >= 1:
            kinds.append("slab_shares_input")
        if len(live_written(call)) >= 1 and len(writable(call)) >= 2:
            kinds.append("row_repeated")
        if call.speculative:
            if any(n >= 2 for n in live_lengths(call).values()):
                kinds.append("L_too_short")
            if call.num_accepted_tokens is not None and call.N:
                kinds.append("accepted_out_of_range")
        else:
            kinds.append("accepted_with_1d")
    else:
        kinds.append("accepted_with_1d")
    if call.cu_seqlens is None and call.seq_lens is None and call.B >= 2:
        kinds.append("cu_seqlens_with_B")
    if call.B == 1 and (call.cu_seqlens is not None or call.seq_lens is not None):
        kinds.append("cu_seqlens_and_seq_lens")
    if call.seq_lens is not None and call.B >= 1:
        kinds.append("seq_lens_out_of_range")
    if any(getattr(call, n) is not None for n in INDEX_ARGS):
        kinds.append("index_shape")
    if not call.slab and call.cu_seqlens is not None and call.T >= 2:
        kinds.append("requires_grad_overlap")
    return kinds


def lengths_of(call: Call) -> list[int]:
    if call.cu_seqlens is not None:
        c = [min(max(x, 0), call.T) for x in call.cu_seqlens]
        return [max(s, e) - s for s, e in itertools.pairwise(c)]
    if call.seq_lens is not None:
        return list(call.seq_lens)
    return [call.T] * call.B


def live_lengths(call: Call) -> dict[int, int]:
    """sequence -> length of the live sequences of a slab call."""
    lengths = lengths_of(call)
    if not call.speculative:
        return {n: lengths[n] for n, r in enumerate(call.state_indices) if r >= 0}
    accepted = call.num_accepted_tokens or (1,) * call.N
    return {n: lengths[n] for n, (row, a) in enumerate(zip(call.state_indices, accepted)) if row[a - 1] >= 0}


def writable(call: Call) -> list[tuple]:
    """Positions of state_indices a live sequence would write if non-negative."""
    live = live_lengths(call)
    if not call.speculative:
        return [(n,) for n in live]
    return [(n, t) for n, length in live.items() for t in range(length)]


def live_written(call: Call) -> list[tuple]:
    """Positions of state_indices a live sequence writes."""
    rows = call.state_indices
    return [p for p in writable(call) if (rows[p[0]] if len(p) == 1 else rows[p[0]][p[1]]) >= 0]


# Each kind of breakage, and what the valid call it breaks must have (valid_calls arguments);
# `applicable` has the last word. In shrinking order: the simple kinds first.
KINDS = {
    "scale": {}, "l2norm_eps": {}, "chunk_size": {}, "rule": {}, "state_layout": {}, "flag": {},
    "backend": {}, "shape": {}, "dtype": {}, "device": {}, "plan": {},
    "index_shape": dict(layouts=("cu_seqlens", "seq_lens"), slabs=("none", "slab", "speculative")),
    "layout_swap": {},
    "missing_decay": dict(rules=GATED), "extra_decay": dict(rules=("linear", "delta")),
    "missing_update": dict(rules=DELTA), "extra_update": {},
    "beta_sigmoid_without_beta": dict(rules=("linear", "gated")),
    "raw_gate_half": dict(rules=GATED), "raw_gate_both": dict(rules=GATED),
    "raw_gate_without_decay": dict(rules=("linear", "delta")),
    "positive_decay": dict(rules=GATED, raw_gates=(False,), min_B=1, min_T=1),
    "cu_seqlens_with_B": dict(layouts=("dense",), min_B=2),
    "cu_seqlens_and_seq_lens": dict(layouts=("cu_seqlens", "seq_lens"), max_B=1, min_B=1),
    "seq_lens_out_of_range": dict(layouts=("seq_lens",), min_B=1),
    "accepted_with_1d": dict(slabs=("none", "slab")),
    "slab_without_state": dict(slabs=("slab", "speculative")),
    "requires_grad_slab": dict(slabs=("slab", "speculative")),
    "requires_grad_overlap": dict(layouts=("cu_seqlens",), slabs=("none",), min_T=2),
    "row_out_of_range": dict(slabs=("slab", "speculative"), min_B=1),
    "row_repeated": dict(slabs=("slab", "speculative"), min_B=2, min_T=1),
    "slab_overlaps_itself": dict(slabs=("slab", "speculative"), min_B=1),
    "slab_shares_input": dict(slabs=("slab", "speculative"), min_B=1, min_T=1),
    "L_too_short": dict(slabs=("speculative",), min_B=1, min_T=2),
    "accepted_out_of_range": dict(slabs=("speculative",), accepted=(True,), min_B=1, min_T=1),
}


@st.composite
def invalid_calls(draw, kind: str | None = None):
    """(Call, Broken): a small valid call (no plan: the index arguments are what breaks) and
    one thing that breaks it, of `kind` (any of KINDS when None)."""
    kind = kind or draw(st.sampled_from(list(KINDS)))
    sizes = dict(max_B=3, max_T=6, max_dim=6, max_N=3, plans=False)
    call = draw(valid_calls(**{**sizes, **KINDS[kind]}))
    assume(kind in applicable(call))
    args_ranks = tensor_ranks(call)
    tensors = sorted(n for n in args_ranks if n not in INDEX_ARGS)
    target, detail = "", ()
    if kind == "shape":
        target = draw(st.sampled_from(tensors))
        how = draw(st.sampled_from(["grow", "rank+", "rank-"]))
        dims = {"q": [0, 1, 3], "k": [0, 1, 3], "v": [0, 1]}.get(
            target, list(range(1 if target == "initial_state" and call.slab else 0, args_ranks[target])))
        detail = (how, draw(st.sampled_from(dims)), draw(st.integers(1, 3)))
    elif kind == "dtype":
        target = draw(st.sampled_from(sorted(args_ranks)))
        if target in INDEX_ARGS:
            choices = ["float32", "int16", "bool"]
        elif target in ("k", "v"):
            choices = [d for d in ("float32", "float16", "bfloat16") if d != call.dtype] + ["float64"]
        else:
            choices = ["float64", "int32", "bool", "complex64"]
        detail = (draw(st.sampled_from(choices)),)
    elif kind == "scale":
        detail = (draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e39, -1e39, 3.5e38,
                                        10**400, "0.5", True, 1j])),)
    elif kind == "l2norm_eps":
        detail = (draw(st.sampled_from([-1e-6, -float("inf"), float("nan"), float("inf"), 1e39, "1e-6", True,
                                        None])),)
    elif kind == "chunk_size":
        detail = (draw(st.sampled_from([0, -1, 1.5, True, "64", None])),)
    elif kind == "rule":
        detail = (draw(st.sampled_from(["gdn", "", None, "GATED", "gated-delta"])),)
    elif kind == "state_layout":
        detail = (draw(st.sampled_from(["KV", "kk", "", None, "v k"])),)
    elif kind == "flag":
        target = draw(st.sampled_from(["qk_l2norm", "beta_sigmoid"]))
        detail = (draw(st.sampled_from([1, 0, "yes", None, 1.0])),)
    elif kind == "device":
        target = draw(st.sampled_from(sorted(n for n in args_ranks if n not in ("q",))) if len(args_ranks) > 1
                      else "k")
    elif kind == "plan":
        options = ["not_a_plan", "other_T", "other_B", "other_device"]
        if call.slab:
            options.append("other_slab_size")
        elif call.state is not None:
            options.append("slab_plan")
        present = [n for n in INDEX_ARGS if getattr(call, n) is not None]
        if present:
            options.append("plan_and_" + draw(st.sampled_from(present)))
        target = draw(st.sampled_from(options))
    elif kind == "backend":
        detail = (draw(st.sampled_from(["nope", "", None, "CPU", ["cpu"]])),)
    elif kind == "missing_update":
        target = "beta" if call.update == "beta" else draw(st.sampled_from(["erase", "write"]))
    elif kind == "extra_update":
        # beside beta an erase or write gate; beside erase / write a beta; any for the other rules
        choices = {"beta": ["erase", "write"], "erase_write": ["beta"]}.get(call.update, ["beta", "erase", "write"])
        target = draw(st.sampled_from(choices))
    elif kind == "extra_decay":
        target = draw(st.sampled_from(["g", "gk"]))
    elif kind == "raw_gate_half":
        target = draw(st.sampled_from(["A_log", "dt_bias"]))
    elif kind == "positive_decay":
        target = draw(st.sampled_from([n for n in ("g", "gk") if n in args_ranks]))
        detail = (draw(st.integers(0, 2**16)), draw(st.sampled_from(["tiny", 0.5, 1.0, "inf", 1e-3])))
    elif kind == "row_out_of_range":
        n = draw(st.integers(0, max(call.N - 1, 0)))
        t = draw(st.integers(0, call.L - 1)) if call.speculative else None
        detail = (n, t, draw(st.sampled_from([0, 1, 1000, 2**31 - 1 - call.num_slots])))
        if call.N == 0:                          # no entry to break
            kind, target = "slab_without_state", ""
    elif kind == "row_repeated":
        src = draw(st.sampled_from(live_written(call)))
        dst = draw(st.sampled_from([p for p in writable(call) if p != src]))
        detail = (src, dst)
    elif kind == "slab_overlaps_itself":
        detail = (draw(st.sampled_from(["expand", "rows", "inner"])),)
    elif kind == "slab_shares_input":
        # inputs with elements (an empty tensor has no memory to share)
        present = [n for n in tensors if n != "initial_state" and (call.B * call.T or n in ("A_log", "dt_bias"))]
        if present:
            target = draw(st.sampled_from(present))
            detail = (draw(st.booleans()),)         # which of the two is copied in last
        else:
            kind = "slab_without_state"
    elif kind == "index_shape":
        target = draw(st.sampled_from(sorted(n for n in INDEX_ARGS if getattr(call, n) is not None)))
        # another length of cu_seqlens is another valid batch; [N, 1] state_indices a valid plan
        hows = {"cu_seqlens": ["rank+", "empty"], "state_indices": ["longer", "shorter"] +
                (["rank+"] if call.speculative else [])}.get(target, ["longer", "shorter", "rank+"])
        detail = (draw(st.sampled_from(hows)),)
    elif kind in ("requires_grad_slab", "requires_grad_overlap"):
        target = draw(st.sampled_from(sorted(n for n in tensors if n != "initial_state" or not call.slab)
                                      + (["initial_state"] if call.slab else [])))
    elif kind == "L_too_short":
        live = live_lengths(call)
        n = draw(st.sampled_from([n for n, length in live.items() if length >= 2]))
        detail = (live[n] - 1,)
    elif kind == "accepted_out_of_range":
        detail = (draw(st.integers(0, call.N - 1)), draw(st.sampled_from([0, -1, call.L + 1, 2**31 - 1])))
    elif kind == "seq_lens_out_of_range":
        detail = (draw(st.integers(0, call.B - 1)), draw(st.sampled_from([-1, call.T + 1, 2**31 - 1])))
    return call, Broken(kind, target, detail)


def break_call(call: Call, broken: Broken) -> tuple[dict, tuple[str, ...]]:
    """(the keyword arguments of `call` with `broken` applied, the argument names the
    ContractError may name). A name "x" also matches "x[...]" (an entry of x)."""
    args = make_args(call, plan=False)
    kind, target, detail = broken.kind, broken.target, broken.detail
    gen = torch.Generator().manual_seed(call.seed + 1)

    if kind == "shape":
        how, dim, grow = detail
        x = args[target]
        if how == "rank+":
            args[target] = x.unsqueeze(-1)
        elif how == "rank-":
            args[target] = x[..., 0] if x.dim() else x.reshape(1)
        else:
            shape = list(x.shape)
            shape[dim] += grow
            y = torch.rand(*shape, generator=gen)
            args[target] = (-y if target in ("g", "gk") else y).to(x.dtype)
        expect = {"q": ("q", "k")}.get(target, (target,))
        return args, expect
    if kind == "dtype":
        new = {"float64": torch.float64, "int32": torch.int32, "int16": torch.int16, "bool": torch.bool,
               "complex64": torch.complex64, **DTYPES}[detail[0]]
        args[target] = args[target].to(new)
        if target in ("k", "v") and new in FLOAT_DTYPES:
            return args, ("k, v",)
        return args, (target,)
    if kind in ("scale", "l2norm_eps", "chunk_size", "rule", "state_layout", "backend"):
        args[kind] = detail[0]
        return args, (kind,)
    if kind == "flag":
        args[target] = detail[0]
        return args, (target,)
    if kind == "layout_swap":
        args["state_layout"] = "kv" if call.state_layout == "vk" else "vk"
        return args, ("initial_state",)
    if kind == "device":
        x = args[target]
        args[target] = torch.empty(x.shape, dtype=x.dtype, device="meta")
        return args, (target,)
    if kind == "plan":
        index = {n: args.pop(n) for n in INDEX_ARGS if n in args}
        slots = call.num_slots if call.slab else None
        if target == "not_a_plan":
            args["plan"] = {"B": call.B, "T": call.T}
        elif target == "other_T":
            args["plan"] = deltarule.plan_batch(call.B, call.T + 1)
        elif target == "other_B":
            args["plan"] = deltarule.plan_batch(call.B + 1, call.T)
        elif target == "other_device":             # meta stands in for a second device
            args["plan"] = deltarule.plan_batch(call.B, call.T, device="meta")
        elif target == "other_slab_size":
            args["plan"] = deltarule.plan_batch(call.B, call.T, **index, num_slots=slots + 1)
        elif target == "slab_plan":             # a slab plan for a call without state_indices
            rows = torch.arange(call.N, dtype=torch.int64)
            # (num_slots = N would make initial_state a valid slab of N rows)
            args["plan"] = deltarule.plan_batch(call.B, call.T, **index, state_indices=rows, num_slots=call.N + 1)
        else:
            name = target[len("plan_and_"):]
            args["plan"] = deltarule.plan_batch(call.B, call.T, **index, num_slots=slots)
            args[name] = index[name]
            return args, (name,)
        return args, ("plan",)
    if kind == "missing_decay":
        for name in ("g", "gk", "A_log", "dt_bias"):
            args.pop(name, None)
        return args, ("g",)
    if kind == "extra_decay":
        B, T, Hv, K = call.B, call.T, call.Hv, call.K
        args[target] = -torch.rand(*((B, T, Hv) if target == "g" else (B, T, Hv, K)), generator=gen)
        return args, (target,)
    if kind == "missing_update":
        args.pop(target)
        args.pop("beta_sigmoid", None)
        return args, (target,)
    if kind == "extra_update":
        B, T, Hv, K, V = call.B, call.T, call.Hv, call.K, call.V
        shape = {"beta": (B, T, Hv), "erase": (B, T, Hv, K), "write": (B, T, Hv, V)}[target]
        args[target] = torch.rand(*shape, generator=gen)
        return args, ("beta",) if call.rule in DELTA else (target,)
    if kind == "beta_sigmoid_without_beta":
        args["beta_sigmoid"] = True
        return args, ("beta_sigmoid",)
    if kind == "raw_gate_half":
        if call.raw_gate:
            args.pop(target)
            return args, (target,)
        args[target] = torch.rand(call.Hv, generator=gen)          # the other one missing
        return args, ("dt_bias" if target == "A_log" else "A_log",)
    if kind in ("raw_gate_both", "raw_gate_without_decay"):
        args["A_log"], args["dt_bias"] = torch.rand(call.Hv, generator=gen), torch.rand(call.Hv, generator=gen)
        return args, ("A_log",)
    if kind == "positive_decay":
        where, value = detail
        # a private contiguous copy: an expanded view has one element for many indices
        x = args[target].clone(memory_format=torch.contiguous_format)
        flat = x.view(-1)
        value = {"tiny": torch.finfo(x.dtype).tiny, "inf": float("inf")}.get(value, value)
        flat[where % flat.numel()] = value
        args[target] = x
        return args, (target,)
    if kind == "row_out_of_range":
        n, t, above = detail
        rows = args["state_indices"].clone()
        rows[(n,) if t is None else (n, t)] = call.num_slots + above
        args["state_indices"] = rows
        return args, ("state_indices",)
    if kind == "row_repeated":
        src, dst = detail
        rows = args["state_indices"].clone()
        rows[dst] = rows[src]
        args["state_indices"] = rows
        return args, ("state_indices",)
    if kind == "slab_without_state":
        args.pop("initial_state")
        return args, ("initial_state",)
    if kind == "requires_grad_overlap":
        # sequences [0, T) and [1, T) (the empty [T, 1) between them): valid without grad
        args["cu_seqlens"] = torch.tensor([0, call.T, 1, call.T], dtype=args["cu_seqlens"].dtype)
        args.pop("initial_state", None)
        if target == "initial_state":
            target = "q"
    if kind in ("requires_grad_slab", "requires_grad_overlap"):
        args[target] = args[target].detach().clone().requires_grad_(True)
        return args, ("state_indices",) if kind == "requires_grad_slab" else ("cu_seqlens",)
    if kind == "index_shape":
        x, how = args[target], detail[0]
        if how == "rank+":
            args[target] = x.unsqueeze(-1)
        elif how == "empty":
            args[target] = x[:0]                    # N + 1 >= 1 offsets needed
        elif how == "longer":
            args[target] = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        else:
            args[target] = x[:-1] if len(x) else x.new_zeros(1, *x.shape[1:])
        return args, (target,)
    if kind == "slab_overlaps_itself":
        slab = args["initial_state"]
        _, H, a, b = slab.shape
        how = detail[0]
        if how == "inner" and a >= 2 and b >= 2:
            strides = (H * a * b, a * b, 1, 1)       # [i, j] and [i + 1, j - 1] are one element
        elif how == "rows" and H * a * b >= 2:
            strides = (1, a * b, b, 1)               # row s + 1 starts one element after row s
        else:
            args["initial_state"] = slab[:1].expand(slab.shape)
            return args, ("initial_state",)
        size = 1 + sum((n - 1) * s for n, s in zip(slab.shape, strides))
        args["initial_state"] = torch.randn(size, generator=gen).to(slab.dtype).as_strided(slab.shape, strides)
        return args, ("initial_state",)
    if kind == "slab_shares_input":
        slab, x = args["initial_state"], args[target]
        input_first = detail[0]
        nbytes = max(slab.numel() * slab.element_size(), x.numel() * x.element_size())
        buffer = torch.zeros(nbytes + 8, dtype=torch.uint8)
        x_view = buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        slab_view = buffer[:slab.numel() * slab.element_size()].view(slab.dtype).view(slab.shape)
        for view, value in ((slab_view, slab), (x_view, x)) if input_first else ((x_view, x), (slab_view, slab)):
            view.copy_(value)
        args["initial_state"], args[target] = slab_view, x_view
        return args, ("initial_state",)
    if kind == "L_too_short":
        args["state_indices"] = args["state_indices"][:, :detail[0]].clone()
        return args, ("state_indices", "num_accepted_tokens")
    if kind == "accepted_with_1d":
        args["num_accepted_tokens"] = torch.ones(call.N, dtype=torch.int32)
        return args, ("num_accepted_tokens",)
    if kind == "accepted_out_of_range":
        n, value = detail
        accepted = args["num_accepted_tokens"].clone()
        accepted[n] = value
        args["num_accepted_tokens"] = accepted
        return args, ("num_accepted_tokens",)
    if kind == "cu_seqlens_with_B":
        args["cu_seqlens"] = torch.tensor([0, call.T], dtype=torch.int32)
        return args, ("cu_seqlens",)
    if kind == "cu_seqlens_and_seq_lens":
        args.setdefault("cu_seqlens", torch.tensor([0, call.T], dtype=torch.int32))
        args.setdefault("seq_lens", torch.tensor([call.T], dtype=torch.int32))
        return args, ("seq_lens",)
    if kind == "seq_lens_out_of_range":
        b, value = detail
        lengths = args["seq_lens"].to(torch.int64).clone()
        lengths[b] = value
        args["seq_lens"] = lengths
        return args, ("seq_lens",)
    raise AssertionError(f"unknown breakage {kind!r}")

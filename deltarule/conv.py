"""The short causal convolution of the hybrid models' linear layers, over packed sequences
with a conv-state slab (a serving engine's per-request rolling input history).

Each sequence n of a call reads its prior inputs (the last W - 1 inputs before its first
token) from a slab row, convolves, and writes its new history back to a slab row: every
read of a call happens before any write, rows not addressed stay bit-identical. Two
history conventions, both vLLM's:

- plain (prefill / decode): the prior is columns [0, W - 1) of the row; afterwards those
  columns hold the last W - 1 inputs of (prior, tokens).
- rolling (speculative decoding, a row of S = W - 1 + num_spec columns): the prior is
  columns [a - 1, a - 1 + W - 1) with a the sequence's accepted-token count (the W - 1
  inputs ending at the last accepted token); afterwards columns [0, W - 2 + L) hold the
  prior's last W - 2 inputs followed by the sequence's L tokens, so that the next step's
  prior for a' accepted tokens is again columns [a' - 1, a' - 1 + W - 1) (vLLM's GPU
  ``causal_conv1d_update``; columns past W - 2 + L are left as they are).

`plan_conv` turns the layout into gather indices once (a serving step builds it once for
every layer); `causal_conv1d_slab` runs one call; `reference_conv1d_slab` is its float64
twin, a loop over sequences.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import aliasing
from .errors import ContractError
from .kernels.cpu import conv as cpu_conv

ACTIVATIONS = (None, "silu")
BACKENDS = ("auto", "cpu", "torch")
_STATE_TYPES = (torch.float32, torch.bfloat16, torch.float16)
_INPUT_TYPES = _STATE_TYPES          # x, weight, bias: the arithmetic is float32 (float64: reference_conv1d_slab)


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


def causal_conv1d_slab(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                       plan: ConvPlan, *, activation: str | None = "silu", backend: str = "auto",
                       splits: tuple[int, ...] | None = None, out: torch.Tensor | None = None):
    """Depthwise causal convolution of packed sequences, reading and updating `conv_state`.

    Args:
        x: [T, C] token-major inputs (any strides), float32 / bfloat16 / float16 (float64:
            `reference_conv1d_slab`).
        weight: [C, W] taps, float32 / bfloat16 / float16; weight[:, W - 1] multiplies the
            current token.
        bias: [C] or None, float32 / bfloat16 / float16.
        conv_state: [slots, S', C] slab (any strides: vLLM's [slots, C, S'] memory is passed as
            its transpose), x's dtype or float32, sharing no memory with itself, x, weight or
            bias; the plan's rows are updated IN PLACE.
        plan: from `plan_conv` (S <= S'; every row it names < slots).
        activation: None or "silu".
        backend: "cpu" (the native kernel, csrc/conv.c: CPU tensors, x with channel stride 1,
            W <= 16), "torch" (gathers, any device), or "auto" (default): cpu where it applies.
        splits: None, or up to 4 channel counts summing to C: return the output split along
            its channels into that many contiguous tensors (a layer's q, k, v: the cpu form
            writes them where they lie).
        out: None, or a contiguous 1-D tensor of x's dtype and device with at least T * C
            elements: the outputs are written into its first T * C (the returned tensors are
            views of it; a caller's workspace kept between calls, so that a layer's prefill
            does not allocate and free tens of MB per call).

    Returns [T, C] (or the `splits` tuple of [T, C_i]) in x's dtype, computed in float32:
    out[t] = act(bias + sum_j weight[:, j] * input(t - (W - 1) + j)).

    Raises ContractError for any invalid argument, before any work (nothing written); also
    with autograd on and an argument that requires grad (not differentiable).

    >>> plan = plan_conv([2], width=2, read_rows=[0], write_rows=[0])
    >>> state = torch.full((1, 1, 1), 10.)
    >>> causal_conv1d_slab(torch.tensor([[1.], [2.]]), torch.ones(1, 2), None, state, plan, activation=None)
    tensor([[11.],
            [ 3.]])
    >>> state.flatten().tolist()
    [2.0]
    """
    T, C, W, S, parts, native = _checked(x, weight, bias, conv_state, plan, activation, backend, splits, out)
    if native and backend != "torch":
        flat = torch.empty(T * C, dtype=x.dtype) if out is None else out[:T * C]
        wt, b = _prepared(weight, bias)
        cpu_conv.conv(x, flat, wt, b, conv_state, plan.table, rolling=plan.rolling, silu=activation == "silu",
                      gather=plan.crossed, splits=parts)
        views = _views(flat, T, parts)
        return views[0] if splits is None else views
    # the plan's tables live on the host: gathers on another device take their indices there
    device = x.device
    read = plan.table[:, 2].to(device)                            # -1: no prior, zeros
    taps = plan.taps.to(device)
    if conv_state.shape[0]:
        prior = conv_state.index_select(0, read.clamp(min=0))[:, :S].float()
        prior[read < 0] = 0
    else:                                                         # a slab of no rows: every row is padding
        prior = torch.zeros(read.shape[0], S, C, device=device)
    src = torch.cat((prior.reshape(prior.shape[0] * S, C), x.float()))
    w = weight.float()
    acc = src.index_select(0, taps[W - 1]) * w[:, W - 1]
    for j in range(W - 1):
        acc.addcmul_(src.index_select(0, taps[j]), w[:, j])
    if bias is not None:
        acc += bias.float()
    if activation == "silu":
        acc = F.silu(acc, inplace=True)
    if plan.write_rows.numel():
        conv_state.index_put_((plan.write_rows.to(device), plan.write_cols.to(device)),
                              src.index_select(0, plan.write_src.to(device)).to(conv_state.dtype))
    results = acc.split(list(parts), dim=1)
    if out is None:
        results = tuple(r.to(x.dtype).contiguous() for r in results)
    else:
        views = _views(out, T, parts)
        for view, r in zip(views, results):
            view.copy_(r)
        results = views
    return results[0] if splits is None else results


def _views(flat: torch.Tensor, T: int, parts: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The output parts [T, parts[i]] laid one after the other from the start of `flat`."""
    views, at = [], 0
    for width in parts:
        views.append(flat[at:at + T * width].view(T, width))
        at += T * width
    return tuple(views)


def _checked(x, weight, bias, conv_state, plan, activation, backend, splits, out):
    """`causal_conv1d_slab`'s argument checks, every one before any work: (T, C, W, S, the
    output parts' channel counts, whether the cpu form takes the call) or ContractError."""
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ContractError("activation", f"one of {ACTIVATIONS}", repr(activation))
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ContractError("backend", f"one of {BACKENDS}", repr(backend))
    if not isinstance(plan, ConvPlan):
        raise ContractError("plan", "a deltarule.conv.ConvPlan (plan_conv)", type(plan).__name__)
    _tensor("x", x, 2, _INPUT_TYPES, "[T, C]")
    device = x.device
    T, C = x.shape
    W, S = plan.width, plan.columns
    if T != plan.tokens:
        raise ContractError("x", f"[T, C] with T = {plan.tokens} (the plan's tokens)", tuple(x.shape))
    _tensor("weight", weight, 2, _INPUT_TYPES, f"[C, W] = [{C}, {W}]", device, (C, W))
    if bias is not None:
        _tensor("bias", bias, 1, _INPUT_TYPES, f"[C] = [{C}]", device, (C,))
    _tensor("conv_state", conv_state, 3, _STATE_TYPES, f"[slots, S >= {S}, C = {C}]", device)
    if conv_state.shape[1] < S or conv_state.shape[2] != C:
        raise ContractError("conv_state", f"[slots, S >= {S}, C = {C}]", tuple(conv_state.shape))
    if conv_state.dtype not in (x.dtype, torch.float32):
        raise ContractError("conv_state", f"x's dtype {x.dtype} or torch.float32", conv_state.dtype)
    plan.check_slab(conv_state.shape[0])
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state)):
            if t is not None and t.requires_grad:
                raise ContractError(name, "a tensor that does not require grad, or autograd off (the convolution "
                                    "is not differentiable: conv_state is updated in place)", "requires_grad=True")
    native = (device.type == "cpu" and x.stride(1) == 1 and W <= 16 and cpu_conv.available())
    if backend == "cpu" and not native:
        why = (f"x on {device}" if device.type != "cpu" else f"x's channel stride {x.stride(1)}"
               if x.stride(1) != 1 else f"W = {W}" if W > 16 else "the native kernel not built")
        raise ContractError("backend", "'cpu' for CPU tensors with x's channel stride 1 and W <= 16 "
                            "(and the native kernel built)", f"'cpu' with {why}")
    if splits is None:
        parts = (C,)                                 # C = 0 too: a [T, 0] output
    elif not isinstance(splits, (tuple, list)) or not 1 <= len(splits) <= cpu_conv.MAX_PARTS \
            or any(isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1 for p in splits) \
            or sum(splits) != C:
        raise ContractError("splits", f"1 to {cpu_conv.MAX_PARTS} positive channel counts summing to {C}", splits)
    else:
        parts = tuple(int(p) for p in splits)
    if out is not None and (not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous()
                            or out.numel() < T * C or out.dtype != x.dtype or out.device != device):
        raise ContractError("out", f"a contiguous 1-D {x.dtype} tensor on {device} of >= {T * C} elements",
                            (tuple(out.shape), out.dtype, str(out.device), out.is_contiguous())
                            if isinstance(out, torch.Tensor) else type(out).__name__)
    # conv_state is written after every read of x, weight and bias (a view of the slab among them
    # would be read after a write), and so is out
    aliasing.check_written("conv_state", conv_state, (("x", x), ("weight", weight), ("bias", bias)))
    if out is not None:
        aliasing.check_written("out", out[:T * C], (("x", x), ("weight", weight), ("bias", bias),
                                                    ("conv_state", conv_state)))
    return T, C, W, S, parts, native


def _tensor(name, t, rank, dtypes, shape, device=None, exact=None):
    """A tensor argument of `rank`, one of `dtypes`, on `device`, of shape `exact` where given
    (`shape`: the expected shape in words), or ContractError."""
    if not isinstance(t, torch.Tensor):
        raise ContractError(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != rank or (exact is not None and tuple(t.shape) != exact):
        raise ContractError(name, shape, tuple(t.shape))
    if t.dtype not in dtypes:
        raise ContractError(name, "dtype " + " / ".join(str(d) for d in dtypes), t.dtype)
    if device is not None and t.device != device:
        raise ContractError(name, f"device {device} (x's)", t.device)


class KeptConv:
    """`causal_conv1d_slab`'s cpu form (with `splits` and `out`) for one plan and call
    signature, checked once as the function checks every call: calling it with tensors of the
    example's shapes, dtypes and strides runs the kernel with no checks but the taps' version
    (a weight or bias changed in place is converted again). For a caller that keeps it per
    layer (the vLLM plugin's decode steps) and guarantees what the function checks per call:
    x, conv_state and out of the example's signature, out sharing no memory with the others.
    Calling returns the parts as `causal_conv1d_slab` does, views of `out`."""

    def __init__(self, x, weight, bias, conv_state, plan: ConvPlan, *, activation: str | None,
                 splits: tuple[int, ...], out: torch.Tensor):
        T, C, W, S, parts, native = _checked(x, weight, bias, conv_state, plan, activation, "cpu", splits, out)
        self.weight, self.bias, self.T, self.parts = weight, bias, T, parts
        wt, b = _prepared(weight, bias)
        self.launch = cpu_conv.ConvLaunch(x, out[:T * C], wt, b, conv_state, plan.table, rolling=plan.rolling,
                                          silu=activation == "silu", gather=plan.crossed, splits=parts)

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.run(x, conv_state, out)
        return self.views(out)

    def views(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output parts [T, splits[i]] as views of `out` (what a call returns; no kernel)."""
        return _views(out, self.T, self.parts)

    def run(self, x: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor) -> None:
        """`__call__` without making the views (for a caller that keeps its own)."""
        wt, b = _prepared(self.weight, self.bias)
        self.launch.run(x.data_ptr(), out.data_ptr(), wt.data_ptr(), 0 if b is None else b.data_ptr(),
                        conv_state.data_ptr())


_PREPARED: OrderedDict = OrderedDict()


def _prepared(weight: torch.Tensor, bias: torch.Tensor | None):
    """weight as [W, C] float32 and bias as float32, kept per (tensor, version): a layer's
    taps are converted once, not per call. Entries hold their tensors, so an id is never
    reused while cached."""
    key = (id(weight), id(bias))
    versions = (weight._version, None if bias is None else bias._version)
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not weight or hit[1] is not bias or hit[2] != versions:
        hit = (weight, bias, versions, weight.t().float().contiguous(),
               None if bias is None else bias.float().contiguous())
        _PREPARED[key] = hit
        while len(_PREPARED) > 256:
            _PREPARED.popitem(last=False)
    return hit[3], hit[4]


def reference_conv1d_slab(x, weight, bias, conv_state, *, lengths, read_rows, write_rows, fresh=None,
                          accepted=None, activation="silu"):
    """float64 twin of `causal_conv1d_slab`, one sequence at a time: returns (out [T, C] float64,
    the updated slab as a float64 copy). Takes `plan_conv`'s arguments instead of a plan."""
    W = weight.shape[1]
    x, w = x.double(), weight.double()
    state = conv_state.double().clone()
    old = conv_state.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    start = 0
    for n, L in enumerate(lengths):
        o = accepted[n] - 1 if accepted is not None else 0
        prior = torch.zeros(W - 1, x.shape[1], dtype=torch.float64) \
            if (fresh is not None and fresh[n]) or read_rows[n] < 0 else old[read_rows[n], o:o + W - 1]
        seq = torch.cat((prior, x[start:start + L]))
        for i in range(L):
            acc = (seq[i:i + W] * w.T).sum(0) + (bias.double() if bias is not None else 0)
            out[start + i] = F.silu(acc) if activation == "silu" else acc
        if L and write_rows[n] >= 0:
            if accepted is not None:
                state[write_rows[n], :W - 2 + L] = torch.cat((prior[1:], x[start:start + L]))
            else:
                state[write_rows[n], :W - 1] = seq[-(W - 1):] if W > 1 else seq[:0]
        start += L
    return out, state


def causal_conv1d_with_state(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             state: torch.Tensor | None = None, *, activation: str | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The short causal convolution of one call with a dense state: ONNX's ``CausalConvWithState``
    (opset 27), and what `deltarule.export` turns a model's convolution into.

    Args:
        x: [B, C, T] float32 / bfloat16 / float16, the input, channels first.
        weight: [C, W] (or ONNX's [C, 1, W]), x's dtype: one kernel of width W per channel.
        bias: [C] or None (default).
        state: [B, C, W - 1], x's dtype: the W - 1 inputs before x's first token (oldest first);
            None (default): zeros. Not modified.
        activation: None (default) or "silu".

    Returns:
        (y [B, C, T] in x's dtype, new_state [B, C, W - 1]: the last W - 1 inputs of
        (state, x)). The arithmetic is float32.

    Traced (`torch.compile`, `torch.export`) the call is one op, ``deltarule::causal_conv1d_with_state``.

    Example::

        >>> x = torch.arange(6.).reshape(1, 1, 6)
        >>> y, s = causal_conv1d_with_state(x, torch.ones(1, 3), state=torch.full((1, 1, 2), 10.))
        >>> y.tolist(), s.tolist()
        ([[[20.0, 11.0, 3.0, 6.0, 9.0, 12.0]]], [[[4.0, 5.0]]])
    """
    _check_with_state(x, weight, bias, state, activation)
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if torch.compiler.is_compiling():
        from . import library
        return library.conv1d_with_state(x, weight, bias, state, activation)
    return conv1d_with_state(x, weight, bias, state, activation)


def conv1d_with_state(x, weight, bias, state, activation):
    """`causal_conv1d_with_state` on checked arguments (weight [C, W]): torch's grouped conv1d
    over (state, x) in float32."""
    B, C, T = x.shape
    W = weight.shape[-1]
    prior = x.new_zeros(B, C, W - 1) if state is None else state
    # float32 before the concatenation: a float32 state beside a 16-bit x is not rounded to x's dtype
    full = torch.cat((prior.float(), x.float()), dim=-1)
    if C and T:
        y = F.conv1d(full, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=C)
        if activation == "silu":
            y = F.silu(y)
    else:                              # F.conv1d takes neither 0 groups nor an input shorter than W
        y = x.new_empty(B, C, T)       # no outputs; the new state below is still (state, x)'s last W - 1
    return y.to(x.dtype), full[..., full.shape[-1] - (W - 1):].to(prior.dtype).clone()


def _check_with_state(x, weight, bias, state, activation):
    """`causal_conv1d_with_state`'s argument checks, every one before any work (ContractError)."""
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ContractError("activation", " | ".join(repr(a) for a in ACTIVATIONS), repr(activation))
    _tensor("x", x, 3, _INPUT_TYPES, "[B, C, T]")
    B, C = x.shape[0], x.shape[1]
    flat = weight.squeeze(1) if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] == 1 \
        else weight
    W = max(flat.shape[-1], 1) if isinstance(flat, torch.Tensor) and flat.dim() == 2 else 1
    # every tensor on x's device: torch would raise its own RuntimeError mid-call otherwise
    _tensor("weight", flat, 2, _INPUT_TYPES, f"[C, W] or [C, 1, W] with C = {C}, W >= 1", x.device, (C, W))
    if bias is not None:
        _tensor("bias", bias, 1, _INPUT_TYPES, f"[C] = [{C}] or None", x.device, (C,))
    if state is not None:
        _tensor("state", state, 3, _INPUT_TYPES, f"[B, C, W - 1] = [{B}, {C}, {W - 1}] or None", x.device,
                (B, C, W - 1))

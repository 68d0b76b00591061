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

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import aliasing
from .errors import ContractError
from .kernels import cpu_conv

ACTIVATIONS = (None, "silu")
BACKENDS = ("auto", "cpu", "torch")
_STATE_TYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def plan_conv(lengths: list[int], *, width: int, read_rows: list[int], write_rows: list[int],
              fresh: list[bool] | None = None, accepted: list[int] | None = None,
              columns: int | None = None) -> ConvPlan:
    """The gather indices of a call over sequences of `lengths` (packed in order).

    Args:
        lengths: [N] token counts, >= 0 (a sequence of 0 tokens is skipped: nothing read or
            written).
        width: W, the taps per channel (>= 1).
        read_rows / write_rows: [N] slab rows (vLLM reads and writes one row per sequence).
        fresh: [N] True where the sequence has no prior (reads zeros); default none. A
            negative read row reads zeros too; a negative write row writes nothing.
        accepted: [N] accepted-token counts >= 1 of the rolling convention; None: plain.
        columns: S, the slab's column count; default W - 1 (plain), required with `accepted`.
    """
    N, W = len(lengths), width
    if W < 1:
        raise ContractError("width", ">= 1", W)
    S = W - 1 if columns is None else columns
    if len(read_rows) != N or len(write_rows) != N:
        raise ContractError("read_rows / write_rows", f"{N} rows each", (len(read_rows), len(write_rows)))
    if S < W - 1:
        raise ContractError("columns", f">= width - 1 = {W - 1}", S)
    if accepted is not None and any(not 1 <= a <= S - W + 2 for a in accepted):
        raise ContractError("accepted", f"in [1, {S - W + 2}]", accepted)
    if accepted is not None and W < 2:
        raise ContractError("width", ">= 2 with the rolling convention", W)
    if accepted is not None and any(W - 2 + L > S for L in lengths):
        raise ContractError("lengths", f"<= {S - W + 2} (W - 2 + L within the {S} columns of a rolling row)",
                            lengths)
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
    # sequences run in order, so only a row written before a later sequence reads it is a hazard
    # (conservatively: a row some other sequence reads last)
    last_reader = {r: n for n, r in enumerate(reads) if r >= 0}
    crossed = any(last_reader.get(write_rows[n], n) != n for n in live)
    return ConvPlan(W, S, taps, w_rows, cols[keep], src[keep], T, table.contiguous(), accepted is not None, crossed)


def causal_conv1d_slab(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                       plan: ConvPlan, *, activation: str | None = "silu", backend: str = "auto",
                       splits: tuple[int, ...] | None = None, out: torch.Tensor | None = None):
    """Depthwise causal convolution of packed sequences, reading and updating `conv_state`.

    Args:
        x: [T, C] token-major inputs (any strides), float32 / bfloat16 / float16.
        weight: [C, W] taps; weight[:, W - 1] multiplies the current token.
        bias: [C] or None.
        conv_state: [slots, S', C] slab (any strides: vLLM's [slots, C, S'] memory is passed as
            its transpose), x's dtype or float32; the plan's rows are updated IN PLACE.
        plan: from `plan_conv` (S <= S').
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
    read = plan.table[:, 2]                                       # -1: no prior, zeros
    prior = conv_state.index_select(0, read.clamp(min=0))[:, :S].float()
    prior[read < 0] = 0
    src = torch.cat((prior.reshape(-1, C), x.float()))
    w = weight.float()
    acc = src.index_select(0, plan.taps[W - 1]) * w[:, W - 1]
    for j in range(W - 1):
        acc.addcmul_(src.index_select(0, plan.taps[j]), w[:, j])
    if bias is not None:
        acc += bias.float()
    if activation == "silu":
        acc = F.silu(acc, inplace=True)
    if plan.write_rows.numel():
        conv_state.index_put_((plan.write_rows, plan.write_cols),
                              src.index_select(0, plan.write_src).to(conv_state.dtype))
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
    """`causal_conv1d_slab`'s argument checks: (T, C, W, S, the output parts' channel counts,
    whether the cpu form takes the call) or ContractError."""
    if activation not in ACTIVATIONS:
        raise ContractError("activation", f"one of {ACTIVATIONS}", activation)
    if backend not in BACKENDS:
        raise ContractError("backend", f"one of {BACKENDS}", backend)
    T, C = x.shape
    W, S = plan.width, plan.columns
    if T != plan.tokens or weight.shape != (C, W) or conv_state.shape[1] < S or conv_state.shape[2] != C:
        raise ContractError("x / weight / conv_state", f"[{plan.tokens}, C], [C, {W}], [slots, >= {S}, C]",
                            (tuple(x.shape), tuple(weight.shape), tuple(conv_state.shape)))
    native = (x.device.type == "cpu" and conv_state.device.type == "cpu" and x.stride(1) == 1 and W <= 16
              and conv_state.dtype in _STATE_TYPES and cpu_conv.available())
    if backend == "cpu" and not native:
        raise ContractError("backend", "'cpu' for CPU tensors with x's channel stride 1 and W <= 16 "
                            "(and the native kernel built)", backend)
    parts = (C,) if splits is None else tuple(splits)
    if sum(parts) != C or not 1 <= len(parts) <= cpu_conv.MAX_PARTS or min(parts) < 1:
        raise ContractError("splits", f"1 to {cpu_conv.MAX_PARTS} positive channel counts summing to {C}", splits)
    if out is not None and (out.dim() != 1 or not out.is_contiguous() or out.numel() < T * C
                            or out.dtype != x.dtype or out.device != x.device):
        raise ContractError("out", f"a contiguous 1-D {x.dtype} tensor on {x.device} of >= {T * C} elements",
                            (tuple(out.shape), out.dtype, str(out.device), out.is_contiguous()))
    if out is not None:
        aliasing.check_written("out", out[:T * C], (("x", x), ("weight", weight), ("bias", bias),
                                                    ("conv_state", conv_state)))
    return T, C, W, S, parts, native


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

"""`deltarule.conv`'s contract (issue 32): every call against a plain `F.conv1d` reference,
one sequence at a time, on every backend (hypothesis draws the layouts: rows in range,
padding rows, empty sequences, rolling rows, width 1, zero channels, strided slabs and
inputs, 16-bit inputs and states); every invalid call refused with a `ContractError` before
any work, the slab's storage bit-identical. tests/test_vllm_core.py holds the named vLLM
layouts against the float64 twin (`reference_conv1d_slab`) and the cpu form's threads.
.ci/sanitize runs this file against the C kernel built with ASan / UBSan: an out-of-range row
must be refused before csrc/conv.c would read or write it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, note
from hypothesis import strategies as st

from deltarule import ContractError
from deltarule.conv import causal_conv1d_slab, plan_conv
from deltarule.kernels.cpu import conv as cpu_conv

from conftest import rel
from test_properties import examples, storage_bytes

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not cpu_conv.available(), reason="no native conv kernel"))
BACKENDS = [CPU, "torch", "auto"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 8e-3}


def conv1d_reference(x, weight, bias, slab, *, lengths, read_rows, write_rows, fresh=None, accepted=None,
                     activation=None):
    """The call one sequence at a time with `F.conv1d` in float64: (out [T, C], the slab as it
    must be afterwards, float64). A sequence's input is its prior (W - 1 columns of its read
    row from column accepted - 1, zeros for a fresh or negative row) then its tokens; its
    write row (unless negative, or the sequence empty) then holds the last W - 1 of them
    (plain) or the prior's last W - 2 then the tokens (rolling)."""
    T, C = x.shape
    W = weight.shape[1]
    out = torch.zeros(T, C, dtype=torch.float64)
    old, new = slab.double(), slab.double().clone()
    start = 0
    for n, L in enumerate(lengths):
        o = 0 if accepted is None else accepted[n] - 1
        if (fresh is not None and fresh[n]) or read_rows[n] < 0:
            prior = torch.zeros(W - 1, C, dtype=torch.float64)
        else:
            prior = old[read_rows[n], o:o + W - 1]
        seq = torch.cat((prior, x[start:start + L].double()))
        if L and C:
            y = F.conv1d(seq.T[None], weight.double()[:, None, :], None if bias is None else bias.double(),
                         groups=C)[0].T
            out[start:start + L] = F.silu(y) if activation == "silu" else y
        if L and write_rows[n] >= 0:
            if accepted is None:
                new[write_rows[n], :W - 1] = seq[seq.shape[0] - (W - 1):]
            else:
                new[write_rows[n], :W - 2 + L] = torch.cat((prior[1:], x[start:start + L].double()))
        start += L
    return out, new


# ---------------------------------------------------------------------------------------
# drawn calls


@st.composite
def layouts(draw, *, max_slots=6):
    """plan_conv's keyword arguments of a valid layout, and the slab's row count: rows in
    [-1, slots) (negative: padding), the write rows of sequences with tokens distinct
    (those of empty sequences and padding may repeat), often a sequence's own row."""
    W = draw(st.integers(1, 5))
    rolling = W >= 2 and draw(st.booleans())
    spec = draw(st.integers(0, 3)) if rolling else 0
    S = W - 1 + spec
    N = draw(st.integers(0, 4))
    lengths = [draw(st.integers(0, spec + 1 if rolling else 5)) for _ in range(N)]
    slots = draw(st.integers(0, max_slots))
    row = st.integers(-1, slots - 1)
    read, write, taken = [], [], set()
    for L in lengths:
        r = draw(row)
        w = r if draw(st.booleans()) else draw(row)
        if L and w >= 0 and w in taken:
            w = -1
        if L and w >= 0:
            taken.add(w)
        read.append(r)
        write.append(w)
    layout = dict(lengths=lengths, width=W, read_rows=read, write_rows=write,
                  fresh=draw(st.none() | st.lists(st.booleans(), min_size=N, max_size=N)))
    if rolling:
        layout.update(accepted=[draw(st.integers(1, spec + 1)) for _ in range(N)], columns=S)
    return layout, slots


@st.composite
def calls(draw, layout=None):
    """(layout, slots, tensors, options) of a valid call: x [T, C] (contiguous, every other row
    of a buffer, or channel-strided), weight [C, W] and bias of any of the three dtypes, a slab
    [slots, S', C] of x's dtype or float32 (S' >= S; contiguous or vLLM's [slots, C, S']
    memory), activation, splits."""
    layout, slots = layout or draw(layouts())
    T, W = sum(layout["lengths"]), layout["width"]
    S = layout.get("columns", W - 1)
    C = draw(st.sampled_from([0, 1, 3, 8, 37]))
    dtype = draw(st.sampled_from(DTYPES))
    state_dtype = draw(st.sampled_from([dtype, torch.float32]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    x_layout = draw(st.sampled_from(["contiguous", "every-other-token", "channel-strided"]))
    x = torch.randn(2 * T if x_layout == "every-other-token" else T, C, generator=g).to(dtype)
    x = x[::2] if x_layout == "every-other-token" else x.T.contiguous().T if x_layout == "channel-strided" else x
    extra = draw(st.integers(0, 1))
    if draw(st.booleans()):
        slab = torch.randn(slots, S + extra, C, generator=g).to(state_dtype)
    else:
        slab = torch.randn(slots, C, S + extra, generator=g).to(state_dtype).transpose(1, 2)
    weight = torch.randn(C, W, generator=g).to(draw(st.sampled_from(DTYPES)))
    bias = torch.randn(C, generator=g).to(draw(st.sampled_from(DTYPES))) if draw(st.booleans()) else None
    splits = None
    if C >= 3 and draw(st.booleans()):
        splits = (1, C - 3, 2) if C > 3 else (1, 2)
    options = dict(activation=draw(st.sampled_from([None, "silu"])), splits=splits)
    return layout, slots, (x, weight, bias, slab), options


def _backend(backend: str, x: torch.Tensor) -> str:
    """The test's backend, "torch" for an x the cpu form does not take (channel stride > 1)."""
    return "torch" if backend == "cpu" and x.shape[1] > 1 and x.stride(1) != 1 else backend


@pytest.mark.parametrize("backend", BACKENDS)
@examples(300)
@given(call=calls())
def test_conv_matches_conv1d(backend, call):
    """Every valid call: outputs within the input dtype's rounding of F.conv1d's, the slab's
    written rows exactly the reference's (they are copies), every other byte untouched."""
    layout, slots, (x, weight, bias, slab), options = call
    note(f"layout={layout} slots={slots} x={tuple(x.shape)}/{x.stride()} {x.dtype} slab={tuple(slab.shape)}/"
         f"{slab.stride()} {slab.dtype} {options}")
    want_out, want_slab = conv1d_reference(x, weight, bias, slab, activation=options["activation"],
                                           **{k: v for k, v in layout.items() if k not in ("width", "columns")})
    plan = plan_conv(**layout)
    got = causal_conv1d_slab(x, weight, bias, slab, plan, backend=_backend(backend, x), **options)
    out = got if options["splits"] is None else torch.cat(got, dim=1)
    assert out.dtype == x.dtype and out.shape == x.shape
    if out.numel():
        assert rel(out, want_out) < TOL[x.dtype]
    assert torch.equal(slab.double(), want_slab.to(slab.dtype).double())


@pytest.mark.parametrize("backend", BACKENDS)
@examples(100)
@given(call=calls(), where=st.sampled_from(["read_rows", "write_rows"]), data=st.data())
def test_conv_refuses_a_row_out_of_range(backend, call, where, data):
    """A row at or past the slab's rows, read or written (a fresh, padding-written or empty
    sequence's too): refused naming the plan, before any work, the slab's storage and the
    workspace bit-identical."""
    layout, slots, (x, weight, bias, slab), options = call
    N = len(layout["lengths"])
    if not N:
        layout, N = dict(layout, lengths=[0], read_rows=[-1], write_rows=[-1], fresh=None,
                         **({"accepted": [1]} if "accepted" in layout else {})), 1
    n = data.draw(st.integers(0, N - 1))
    rows = list(layout[where])
    rows[n] = data.draw(st.integers(slots, slots + 3))
    layout = dict(layout, **{where: rows})
    plan = plan_conv(**layout)
    out = torch.full((x.numel() + 3,), 7.0, dtype=x.dtype)
    before, out_before = storage_bytes(slab), out.clone()
    with pytest.raises(ContractError) as info:
        causal_conv1d_slab(x, weight, bias, slab, plan, backend=_backend(backend, x), out=out, **options)
    assert info.value.argument == "plan" and f"{where}[" in str(info.value.actual)
    assert torch.equal(storage_bytes(slab), before) and torch.equal(out, out_before)


@examples(100)
@given(layout=layouts(max_slots=4), data=st.data())
def test_conv_refuses_a_row_two_sequences_write(layout, data):
    """Two sequences with tokens writing one row (their order would decide the row): refused by
    plan_conv naming the later one; with one of them empty or the row negative, accepted."""
    layout, slots = layout
    lengths, N = layout["lengths"], len(layout["lengths"])
    live = [n for n in range(N) if lengths[n]]
    assume(len(live) >= 2 and slots > 0)
    a, b = sorted(data.draw(st.lists(st.sampled_from(live), min_size=2, max_size=2, unique=True)))
    row = data.draw(st.integers(0, slots - 1))
    rows = [-1 if r == row else r for r in layout["write_rows"]]
    rows[a] = rows[b] = row
    with pytest.raises(ContractError) as info:
        plan_conv(**dict(layout, write_rows=rows))
    assert info.value.argument == f"write_rows[{b}]"
    rows[b] = -1                                          # padding: writes nothing, may repeat
    plan_conv(**dict(layout, write_rows=rows))
    rows[b] = row                                         # an empty sequence writes nothing either
    plan_conv(**dict(layout, write_rows=rows, lengths=[0 if n == b else L for n, L in enumerate(lengths)]))


# ---------------------------------------------------------------------------------------
# the cases, named


def _small(rows=(0, 0), lengths=(1,), C=8, W=4, slots=2):
    plan = plan_conv(list(lengths), width=W, read_rows=[rows[0]] * len(lengths), write_rows=[rows[1]] * len(lengths))
    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    return (torch.randn(T, C, generator=g), torch.randn(C, W, generator=g), None,
            torch.randn(slots, W - 1, C, generator=g), plan)


def assert_conv_refused(argument, x, weight, bias, slab, plan, *, backend, **options):
    """causal_conv1d_slab raises a ContractError naming `argument` ("argument: expected ...")
    and the slab's (and x's) storage keeps every byte."""
    tensors = [t for t in (x, slab) if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    before = [storage_bytes(t) for t in tensors]
    with pytest.raises(ContractError) as info:
        causal_conv1d_slab(x, weight, bias, slab, plan, backend=backend, **options)
    assert info.value.argument == argument, info.value
    assert str(info.value).startswith(f"{argument}: expected ")
    assert all(torch.equal(storage_bytes(t), b) for t, b in zip(tensors, before))
    return info.value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [(9, 0), (0, 9), (2, -1), (-1, 2)], ids=["read-9", "write-9", "read-2", "write-2"])
def test_conv_refuses_rows_past_the_slab(rows, backend):
    """The issue's call: read row 9 (or 2) of a 2-row slab read garbage on cpu, write row 9
    corrupted the heap, torch raised IndexError."""
    x, weight, _, slab, plan = _small(rows)
    error = assert_conv_refused("plan", x, weight, None, slab, plan, backend=backend, activation=None)
    assert str(max(rows)) in str(error.actual) and "< 2" in error.expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [1, 7, 9], ids=lambda n: f"bias-{n}-of-8")
def test_conv_refuses_a_bias_of_another_size(size, backend):
    x, weight, _, slab, plan = _small()
    assert_conv_refused("bias", x, weight, torch.ones(size), slab, plan, backend=backend)


def test_conv_refuses_two_sequences_writing_one_row():
    """The issue's layout (C = 4096: the cpu form's result depended on which task ran last)."""
    with pytest.raises(ContractError, match=r"^write_rows\[1\]: .*distinct.*2 repeated"):
        plan_conv([8, 8], width=4, read_rows=[0, 1], write_rows=[2, 2])


def test_conv_gathers_first_where_a_row_is_written_and_read_by_another():
    """A row one sequence reads and another writes needs every prior gathered first (the cpu
    form's tasks run in any order on threads); a sequence reading its own row does not."""
    assert plan_conv([2, 2], width=4, read_rows=[3, 3], write_rows=[5, 3]).crossed
    assert plan_conv([2, 2], width=4, read_rows=[3, 4], write_rows=[4, 5]).crossed
    assert not plan_conv([2, 2], width=4, read_rows=[3, 4], write_rows=[3, 4]).crossed
    assert not plan_conv([2, 2], width=4, read_rows=[3, 3], write_rows=[5, 6]).crossed


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_reading_a_row_another_writes_matches_conv1d_on_threads(monkeypatch, backend):
    """read_rows [3, 3], write_rows [5, 3] over 3 channel blocks per sequence on 3 threads:
    sequence 0 must read row 3 before sequence 1 rewrites it."""
    g = torch.Generator().manual_seed(3)
    C = 3 * cpu_conv.CHANNEL_BLOCK
    x, weight, slab = torch.randn(4, C, generator=g), torch.randn(C, 4, generator=g), torch.randn(6, 3, C, generator=g)
    layout = dict(lengths=[2, 2], read_rows=[3, 3], write_rows=[5, 3])
    want_out, want_slab = conv1d_reference(x, weight, None, slab, activation="silu", **layout)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu_conv, "ELEMENTS_PER_THREAD", 1)
    out = causal_conv1d_slab(x, weight, None, slab, plan_conv(**layout, width=4), backend=backend)
    assert rel(out, want_out) < 1e-6 and torch.equal(slab.double(), want_slab)


PLAN_ERRORS = {                      # plan_conv's arguments -> the argument named
    "negative-length": (dict(lengths=[-1]), "lengths[0]"),
    "length-not-an-int": (dict(lengths=[1.0]), "lengths[0]"),
    "lengths-not-a-list": (dict(lengths=3), "lengths"),
    "width-float": (dict(width=2.0), "width"),
    "width-bool": (dict(width=True), "width"),
    "width-0": (dict(width=0), "width"),
    "read-row-not-an-int": (dict(read_rows=[0.5]), "read_rows[0]"),
    "row-beyond-int64": (dict(write_rows=[2 ** 64]), "write_rows[0]"),
    "rows-short": (dict(read_rows=[]), "read_rows / write_rows"),
    "fresh-short": (dict(lengths=[1, 1], read_rows=[0, 1], write_rows=[0, 1], fresh=[True]), "fresh"),
    "fresh-not-bools": (dict(fresh=[1]), "fresh"),
    "accepted-short": (dict(lengths=[1, 1], read_rows=[0, 1], write_rows=[0, 1], accepted=[1], columns=4),
                       "accepted"),
    "accepted-0": (dict(accepted=[0], columns=4), "accepted"),
    "columns-below-width": (dict(columns=2), "columns"),
    "columns-float": (dict(columns=3.0), "columns"),
}


@pytest.mark.parametrize("over, argument", PLAN_ERRORS.values(), ids=PLAN_ERRORS.keys())
def test_plan_conv_refuses(over, argument):
    args = dict(lengths=[1], width=4, read_rows=[0], write_rows=[0])
    with pytest.raises(ContractError) as info:
        plan_conv(**{**args, **over})
    assert info.value.argument == argument, info.value


CALL_ERRORS = {                      # (x, weight, bias, conv_state) -> the broken ones, the argument named
    "x-float64": (lambda x, w, b, s: (x.double(), w, b, s), "x"),
    "x-int32": (lambda x, w, b, s: (x.int(), w, b, s), "x"),
    "x-rank-3": (lambda x, w, b, s: (x[None], w, b, s), "x"),
    "x-not-a-tensor": (lambda x, w, b, s: (x.tolist(), w, b, s), "x"),
    "x-other-token-count": (lambda x, w, b, s: (x[:0], w, b, s), "x"),
    "weight-other-width": (lambda x, w, b, s: (x, w[:, :3], b, s), "weight"),
    "weight-other-channels": (lambda x, w, b, s: (x, w[:7], b, s), "weight"),
    "weight-int": (lambda x, w, b, s: (x, w.long(), b, s), "weight"),
    "weight-on-meta": (lambda x, w, b, s: (x, w.to("meta"), b, s), "weight"),
    "bias-rank-2": (lambda x, w, b, s: (x, w, torch.ones(8, 1), s), "bias"),
    "bias-float64": (lambda x, w, b, s: (x, w, torch.ones(8, dtype=torch.float64), s), "bias"),
    "state-rank-2": (lambda x, w, b, s: (x, w, b, s[0]), "conv_state"),
    "state-too-few-columns": (lambda x, w, b, s: (x, w, b, s[:, :2]), "conv_state"),
    "state-other-channels": (lambda x, w, b, s: (x, w, b, s[..., :7]), "conv_state"),
    "state-fp16-for-bf16-x": (lambda x, w, b, s: (x.bfloat16(), w, b, s.half()), "conv_state"),
    "state-bf16-for-fp16-x": (lambda x, w, b, s: (x.half(), w, b, s.bfloat16()), "conv_state"),
    "state-float64": (lambda x, w, b, s: (x, w, b, s.double()), "conv_state"),
    "state-on-meta": (lambda x, w, b, s: (x, w, b, s.to("meta")), "conv_state"),
    "state-expanded": (lambda x, w, b, s: (x, w, b, s[:1].expand(2, -1, -1)), "conv_state"),
    "x-a-view-of-the-state": (lambda x, w, b, s: (s[1, :1], w, b, s), "conv_state"),
    "weight-a-view-of-the-state": (lambda x, w, b, s: (x, s.view(-1)[:32].view(8, 4), b, s), "conv_state"),
    "x-requires-grad": (lambda x, w, b, s: (x.requires_grad_(), w, b, s), "x"),
    "weight-requires-grad": (lambda x, w, b, s: (x, w.requires_grad_(), b, s), "weight"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, argument", CALL_ERRORS.values(), ids=CALL_ERRORS.keys())
def test_conv_refuses(bad, argument, backend):
    x, weight, bias, slab, plan = _small()
    x, weight, bias, slab = bad(x, weight, torch.ones(8), slab)
    assert_conv_refused(argument, x, weight, bias, slab, plan, backend=backend)


OPTION_ERRORS = {
    "activation-swish": (dict(activation="swish"), "activation"),
    "activation-a-list": (dict(activation=["silu"]), "activation"),
    "backend-unknown": (dict(backend="gpu"), "backend"),
    "splits-not-ints": (dict(splits="ab"), "splits"),
    "splits-other-sum": (dict(splits=(4, 3)), "splits"),
    "splits-bools": (dict(splits=(True, 7)), "splits"),
    "out-a-list": (dict(out=[0.0] * 8), "out"),
    "out-too-short": (dict(out=torch.zeros(7)), "out"),
    "plan-none": (dict(plan=None), "plan"),
    "plan-of-linear-attention": (dict(plan="batch"), "plan"),
}


@pytest.mark.parametrize("over, argument", OPTION_ERRORS.values(), ids=OPTION_ERRORS.keys())
def test_conv_refuses_an_option(over, argument):
    x, weight, bias, slab, plan = _small()
    over = dict(over)
    if over.get("plan") == "batch":
        import deltarule
        over["plan"] = deltarule.plan_batch(1, 1)
    plan = over.pop("plan", plan)
    assert_conv_refused(argument, x, weight, bias, slab, plan, **{"backend": "auto", **over})


def test_conv_cpu_refuses_what_only_the_torch_form_runs():
    """backend="cpu" names what it needs: x's channel stride 1, W <= 16."""
    x, weight, bias, slab, plan = _small(lengths=(2,))
    assert x.T.contiguous().T.stride(1) == 2
    assert_conv_refused("backend", x.T.contiguous().T, weight, bias, slab, plan, backend="cpu")
    x, weight, bias, slab, plan = _small(W=17)
    assert_conv_refused("backend", x, weight, bias, slab, plan, backend="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_on_a_slab_of_no_rows(backend):
    """Every sequence padding (negative rows) over a 0-row slab: zero priors, nothing written
    (the torch form's gather failed on it)."""
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(3, 5, generator=g), torch.randn(5, 2, generator=g)
    slab = torch.empty(0, 1, 5)
    layout = dict(lengths=[2, 1], read_rows=[-1, -1], write_rows=[-1, -1])
    want, _ = conv1d_reference(x, weight, None, slab, **layout)
    out = causal_conv1d_slab(x, weight, None, slab, plan_conv(**layout, width=2), activation=None, backend=backend)
    assert rel(out, want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 7])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "no-state"])
def test_conv_with_state_matches_the_slab_twin(T, dtype, with_state):
    """`causal_conv1d_with_state` (the export's conv, ONNX's CausalConvWithState) against the
    float64 twin of the slab conv, one slab row per batch row."""
    from deltarule.conv import causal_conv1d_with_state, reference_conv1d_slab
    B, C, W = 3, 20, 4
    g = torch.Generator().manual_seed(T)
    x = torch.randn(B, C, T, generator=g).to(dtype)
    weight, bias = torch.randn(C, W, generator=g).to(dtype), torch.randn(C, generator=g).to(dtype)
    state = torch.randn(B, C, W - 1, generator=g).to(dtype) if with_state else None
    before = None if state is None else state.clone()
    y, new = causal_conv1d_with_state(x, weight, bias, state, activation="silu")
    slab = (state if with_state else torch.zeros(B, C, W - 1, dtype=dtype)).transpose(1, 2)      # [B, W - 1, C]
    want, want_slab = reference_conv1d_slab(x.transpose(1, 2).reshape(B * T, C), weight, bias, slab,
                                            lengths=[T] * B, read_rows=list(range(B)), write_rows=list(range(B)))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel(y.transpose(1, 2).reshape(B * T, C), want) < tol
    assert torch.equal(new, want_slab.transpose(1, 2).to(dtype)), "the new state is the last W - 1 inputs"
    assert new.dtype == dtype and y.dtype == dtype
    if with_state:
        assert torch.equal(state, before), "the state was modified"


@pytest.mark.parametrize("bad, argument", [
    (dict(x=torch.zeros(2, 5)), "x"), (dict(weight=torch.zeros(6, 4)), "weight"),
    (dict(bias=torch.zeros(4)), "bias"), (dict(state=torch.zeros(2, 5, 4)), "state"),
    (dict(activation="relu"), "activation")])
def test_conv_with_state_refuses(bad, argument):
    from deltarule.conv import causal_conv1d_with_state
    args = dict(x=torch.zeros(2, 5, 3), weight=torch.zeros(5, 4), bias=None, state=torch.zeros(2, 5, 3))
    activation = bad.pop("activation", None)
    args.update(bad)
    with pytest.raises(ContractError, match=argument):
        causal_conv1d_with_state(**args, activation=activation)


# --- causal_conv1d_with_state at every extent (issue 46) ----------------------------------------

@st.composite
def with_state_calls(draw):
    """(x [B, C, T], weight [C, W] or [C, 1, W], bias or None, state [B, C, W - 1] or None,
    activation) of a valid call, empty axes included: T = 0 (a call with no tokens), C = 0,
    B = 0, W = 1; the state of x's dtype or float32."""
    B, C, T, W = (draw(st.sampled_from(s)) for s in ([0, 1, 3], [0, 1, 5], [0, 1, 2, 7], [1, 2, 4]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    x = torch.randn(B, C, T, generator=g).to(dtype)
    weight = torch.randn(C, W, generator=g).to(dtype)
    weight = weight[:, None] if draw(st.booleans()) else weight
    bias = torch.randn(C, generator=g).to(dtype) if draw(st.booleans()) else None
    state = torch.randn(B, C, W - 1, generator=g).to(draw(st.sampled_from([dtype, torch.float32]))) \
        if draw(st.booleans()) else None
    return x, weight, bias, state, draw(st.sampled_from([None, "silu"]))


@examples(150)
@given(call=with_state_calls())
def test_conv_with_state_matches_float64_at_every_extent(call):
    """y against the float64 `F.conv1d` reference, new_state the last W - 1 inputs of (state, x)
    exactly, in the state's dtype: with T = 0 that is the state itself (a copy) or zeros, with
    C = 0 an empty one (torch's conv1d refused both); the state is never modified."""
    from deltarule.conv import causal_conv1d_with_state
    x, weight, bias, state, activation = call
    B, C, T = x.shape
    W = weight.shape[-1]
    before = None if state is None else state.clone()
    y, new = causal_conv1d_with_state(x, weight, bias, state, activation=activation)
    slab = (torch.zeros(B, C, W - 1) if state is None else state).transpose(1, 2)       # [B, W - 1, C]
    want, want_slab = conv1d_reference(x.transpose(1, 2).reshape(B * T, C), weight.reshape(C, W), bias, slab,
                                       lengths=[T] * B, read_rows=list(range(B)), write_rows=list(range(B)),
                                       activation=activation)
    assert y.shape == (B, C, T) and y.dtype == x.dtype
    tol = 1e-6 if x.dtype == torch.float32 else 1e-2
    got = y.transpose(1, 2).reshape(B * T, C).double()
    assert got.numel() == 0 or (got - want).abs().max() <= tol * (1 + want.abs().max())
    state_dtype = x.dtype if state is None else state.dtype
    assert new.shape == (B, C, W - 1) and new.dtype == state_dtype
    assert torch.equal(new, want_slab.transpose(1, 2).to(state_dtype)), "new_state: the last W - 1 inputs"
    if state is not None:
        assert torch.equal(state, before), "the state was modified"
        if state.numel():
            assert new.untyped_storage().data_ptr() != state.untyped_storage().data_ptr(), "not a copy"


@pytest.mark.parametrize("x_shape, w", [((2, 3, 0), 4), ((2, 3, 0), 1), ((2, 0, 5), 4), ((2, 0, 0), 3)],
                         ids=["T0", "T0-W1", "C0", "C0-T0"])
def test_conv_with_state_of_no_tokens_or_channels(x_shape, w):
    """The calls torch's conv1d refused (an input shorter than W, zero groups): an empty y,
    new_state the given state (a float32 one beside a 16-bit x unrounded) or zeros; the traced
    op (its fake included) agrees."""
    from deltarule.conv import causal_conv1d_with_state
    B, C, T = x_shape
    x = torch.randn(x_shape).to(torch.bfloat16)
    state = torch.randn(B, C, w - 1) + 1 / 3                     # float32 values bfloat16 cannot hold
    y, new = causal_conv1d_with_state(x, torch.ones(C, w, dtype=torch.bfloat16), None, state, activation="silu")
    assert y.shape == x_shape and y.dtype == torch.bfloat16
    assert torch.equal(new, state[..., T:] if T < w else x[..., T - (w - 1):].float())
    y, new = causal_conv1d_with_state(x, torch.ones(C, w, dtype=torch.bfloat16))
    assert y.shape == x_shape and new.shape == (B, C, w - 1) and not new.any()
    op = torch.ops.deltarule.causal_conv1d_with_state.default
    for s in (None, state.to(torch.bfloat16), state):                # a float32 state beside bfloat16 x too
        torch.library.opcheck(op, (x, torch.ones(C, w, dtype=torch.bfloat16), None, s, "silu"),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("bad, argument", [
    (dict(weight=torch.zeros(5, 4, device="meta")), "weight"), (dict(bias=torch.zeros(5, device="meta")), "bias"),
    (dict(state=torch.zeros(2, 5, 3, device="meta")), "state"), (dict(activation=["silu"]), "activation"),
    (dict(activation=np.array([1, 2])), "activation"), (dict(x=torch.zeros(2, 5, 3, dtype=torch.complex64)), "x")],
    ids=["weight-device", "bias-device", "state-device", "activation-list", "activation-array", "x-complex"])
def test_conv_with_state_refuses_before_torch_does(bad, argument):
    """An argument on another device than x, or an activation that compares ambiguously: a
    ContractError naming it (torch's RuntimeError mid-call, numpy's ValueError, before)."""
    from deltarule.conv import causal_conv1d_with_state
    args = dict(x=torch.zeros(2, 5, 3), weight=torch.zeros(5, 4), bias=None, state=torch.zeros(2, 5, 3),
                activation=None)
    args.update(bad)
    with pytest.raises(ContractError, match=f"^{argument}: expected "):
        causal_conv1d_with_state(**args)

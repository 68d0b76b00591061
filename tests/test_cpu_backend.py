"""The cpu backend's native kernel beyond the test.json comparison: it is
built wherever a C compiler exists, its threads and its huge-page outputs do
not change a bit, and it writes a strided slab where it lies."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import deltarule
from deltarule import backends, batch, cases
from deltarule.backends import cpu_backend
from deltarule.kernels.cpu import layout as cpu_layout
from deltarule.kernels.cpu import recurrent as cpu_recurrent
from deltarule.tools.check import expected

from conftest import rel

pytestmark = pytest.mark.skipif(not cpu_backend.available() and shutil.which("cc") is None,
                                reason="no C compiler here: the cpu backend's kernel could not be built")

CASE = {"name": "cpu", "seed": 5, "B": 3, "T": 37, "Hq": 8, "Hk": 4, "Hv": 4, "K": 100, "V": 72,
        "decay": "gk", "update": "erase_write", "initial_state": True}


def test_kernel_is_built_where_a_compiler_exists():
    assert cpu_backend.available(), "pip install did not build deltarule/kernels/cpu/csrc/recurrent.c"


@pytest.mark.parametrize("layout, exported", [
    (cpu_layout.PROBLEM, "deltarule_problem_fields"), (cpu_layout.BACKWARD, "deltarule_backward_problem_fields"),
    (cpu_layout.CONV, "deltarule_conv_problem_fields")], ids=lambda x: getattr(x, "name", None))
def test_binding_layouts_are_checked_field_by_field_against_the_c_structs(layout, exported):
    """The binding's tables match the compiled structs, and a table with two fields of one type
    swapped (same total size, which a size check would pass) is refused naming them."""
    symbol = getattr(cpu_recurrent._LIB, exported)
    layout.check(symbol)
    fields = list(layout._fields)
    i = next(n for n in range(len(fields) - 1) if fields[n][1:] == fields[n + 1][1:] == ("i", 1)
             or fields[n][1:] == fields[n + 1][1:] == ("q", 1))
    fields[i], fields[i + 1] = fields[i + 1], fields[i]
    swapped = cpu_layout.Layout(layout.name, tuple(fields))
    assert swapped.size == layout.size
    with pytest.raises(ImportError, match=f"{fields[i][0]}: C .*{fields[i + 1][0]}: C "):
        swapped.check(symbol)
    with pytest.raises(ImportError, match="in C only"):
        cpu_layout.Layout(layout.name, tuple(layout._fields[:-1])).check(symbol)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_threads_do_not_change_a_bit(monkeypatch, cpu_threads, layout):
    args = cases.make_inputs(dict(CASE, state_layout=layout))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    o1, s1 = deltarule.linear_attention(**args, backend="cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", 1)     # 3 threads on this small call
    batch.dense.cache_clear()        # a new plan: the first call's kept launch counted its work for 1 thread
    o3, s3 = deltarule.linear_attention(**args, backend="cpu")
    assert torch.equal(o1, o3) and torch.equal(s1, s3)
    want_o, want_s = expected(args)
    assert rel(o3, want_o) < 5e-5 and rel(s3, want_s) < 5e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_huge_page_outputs_are_written(monkeypatch, nan_poison, dtype):
    args = cases.make_inputs(dict(CASE, initial_state=False), dtype)
    monkeypatch.setattr(cpu_backend, "POOL_MIN_BYTES", 0)             # every output from NumPy
    o, state = deltarule.linear_attention(**args, backend="cpu")
    assert o.dtype == args["v"].dtype
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    want_o, want_s = expected(args)
    tol = 5e-5 if dtype == "float32" else 1e-2
    assert rel(o, want_o) < tol and rel(state, want_s) < tol


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_inputs_are_widened_and_outputs_rounded_like_torch(dtype):
    """The kernel reads 16-bit q, k, v itself and rounds o to nearest even: bit for bit
    what a float32 call on the widened inputs, rounded by torch, gives."""
    args = cases.make_inputs(CASE, dtype)
    o, state = deltarule.linear_attention(**args, backend="cpu")
    wide = dict(args, **{name: args[name].float() for name in ("q", "k", "v")})
    o32, state32 = deltarule.linear_attention(**wide, backend="cpu")
    assert torch.equal(o, o32.to(o.dtype)) and torch.equal(state, state32)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_strided_slab_is_updated_where_it_lies(layout):
    args = cases.make_inputs(dict(CASE, initial_state=False, state_layout=layout))
    K, V = CASE["K"], CASE["V"]
    shape = (5, 4, K, V + 3) if layout == "kv" else (5, 4, V, K + 3)
    wide = torch.randn(*shape)
    slab = wide[..., :-3]                                              # rows not contiguous
    before = wide.clone()
    idx = [4, -1, 1]
    o, out = deltarule.linear_attention(**args, initial_state=slab, state_indices=torch.tensor(idx),
                                        backend="cpu")
    assert out is slab
    dense = dict(args, initial_state=before[..., :-3][[4, 0, 1]].clone())
    want_o, want_s = expected(dense)
    assert rel(slab[4], want_s[0]) < 5e-5 and rel(slab[1], want_s[2]) < 5e-5
    assert rel(o[[0, 2]], want_o[[0, 2]]) < 5e-5
    assert torch.equal(o[1], torch.zeros_like(o[1]))                   # padding sequence
    assert torch.equal(wide[..., -3:], before[..., -3:])               # the gaps between rows
    for row in (0, 2, 3):
        assert torch.equal(wide[row], before[row])


def test_output_pool_recycles_only_dropped_outputs(monkeypatch):
    args = cases.make_inputs(dict(CASE, initial_state=False))
    monkeypatch.setattr(cpu_backend, "POOL_MIN_BYTES", 0)             # every output from the pool
    monkeypatch.setattr(cpu_backend, "_POOL", cpu_backend._OutputPool())
    o1, s1 = deltarule.linear_attention(**args, backend="cpu")
    kept = o1.clone()
    o2, s2 = deltarule.linear_attention(**dict(args, v=-args["v"]), backend="cpu")
    assert o2.data_ptr() != o1.data_ptr() and torch.equal(o1, kept)    # a live output is never reused
    ptr = o1.data_ptr()
    del o1
    o3, _ = deltarule.linear_attention(**args, backend="cpu")
    assert o3.data_ptr() == ptr and torch.equal(o3, kept)               # a dropped one is
    monkeypatch.setattr(cpu_backend, "POOL_BYTES", 0)
    del o2, s2, o3
    assert cpu_backend._POOL._bytes == 0                                 # the pool's size limit holds


def test_extreme_per_key_decays_match_the_reference():
    """exp in the kernel and the lazy decay's restarts: log decays from -200 (underflow to 0)
    through -30 and 0 to +0.3 (growth), mixed across keys and tokens."""
    args = cases.make_inputs(dict(CASE, T=150, initial_state=True))
    gen = torch.Generator().manual_seed(3)
    choices = torch.tensor([-200.0, -30.0, -1.0, -0.01, 0.0, 0.3])
    args["gk"] = choices[torch.randint(0, len(choices), args["gk"].shape, generator=gen)]
    # growth is refused by linear_attention, not by the adapters that reach the kernel
    o, state = backends.dispatch(deltarule.validate(**args, accept_growth=True), "cpu")
    want_o, want_s = expected(args)
    assert rel(o, want_o) < 5e-5 and rel(state, want_s) < 5e-5


DECODE = dict(CASE, T=1, V=128, initial_state=True)      # V a multiple of 64: the direct decode path


@pytest.mark.parametrize("over", [
    dict(decay="g", update="beta"),
    dict(decay="g+gk", update="erase_write"),
    dict(decay="gk", update="beta", Hq=4, Hk=4, Hv=4),
    dict(decay="gk", update="beta", Hq=2, Hk=2, Hv=4),
    dict(decay="g", update="beta", qk_l2norm=True),
    dict(decay="g+gk", update="erase_write", K=99),
], ids=["gdn-gqa", "gdn2-gqa", "kda", "kda-gva", "gdn-l2norm", "gdn2-K99"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_token_decode_from_the_state_where_it_lies(nan_poison, over, dtype):
    args = cases.make_inputs(dict(DECODE, **over), dtype)
    o, state = deltarule.linear_attention(**args, backend="cpu")
    want_o, want_s = expected(args)
    tol = 5e-5 if dtype == "float32" else 1e-2
    assert rel(o, want_o) < tol and rel(state, want_s) < tol


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_single_token_decode_on_a_slab(layout):
    args = cases.make_inputs(dict(DECODE, state_layout=layout, initial_state=True, state_indices=[2, -1, 0],
                                  num_slots=4))
    slab = args["initial_state"]
    before = slab.clone()
    want_o, want_s = expected(args)
    o, out = deltarule.linear_attention(**args, backend="cpu")
    assert out is slab
    assert rel(o, want_o) < 5e-5 and rel(slab, want_s) < 5e-5
    assert torch.equal(slab[[1, 3]], before[[1, 3]]) and torch.equal(o[1], torch.zeros_like(o[1]))


@pytest.mark.parametrize("value, expect", [("own", "own"), ("openmp", "openmp"), ("bogus", "DELTARULE_CPU_THREADS")])
def test_threads_from_the_environment(value, expect):
    """DELTARULE_CPU_THREADS picks the threads at import; a bad value fails the import naming it."""
    code = "from deltarule.kernels.cpu import recurrent; print(recurrent.threads_in_use())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DELTARULE_CPU_THREADS": value})
    assert expect in (run.stdout if run.returncode == 0 else run.stderr), run.stderr[-2000:]
    assert (run.returncode == 0) == (value != "bogus")


def test_concurrent_calls_and_a_forked_child(monkeypatch, cpu_threads):
    """The kernel keeps its helper threads between calls (or runs on torch's OpenMP pool):
    calls from several Python threads at once (with own threads one uses the helpers, the
    others run alone; with OpenMP each calling thread leads a team of its own) and a child
    forked after the threads exist (it starts on its own threads: GNU OpenMP's do not
    survive fork) still compute the right thing."""
    import concurrent.futures
    import select
    import signal

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", 1)
    args = cases.make_inputs(CASE)
    want_o, want_s = expected(args)
    deltarule.linear_attention(**args, backend="cpu")              # the helpers exist from here on
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: deltarule.linear_attention(**args, backend="cpu"), range(8)))
    for o, state in results:
        assert rel(o, want_o) < 5e-5 and rel(state, want_s) < 5e-5
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:                                                   # the child: report, never return
        try:
            torch.set_num_threads(1)                               # GNU OpenMP does not survive fork
            o, state = deltarule.linear_attention(**args, backend="cpu")
            ok = rel(o, want_o) < 5e-5 and rel(state, want_s) < 5e-5
            own = cpu_recurrent.threads_in_use() == "own"
            os.write(write_end, b"ok" if ok and own else b"wrong" if own else b"on OpenMP after fork")
        finally:
            os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 120)
    answer = os.read(read_end, 16) if ready else b"no answer in 120 s"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read_end)
    assert answer == b"ok", answer


# The kernel called directly (deltarule/kernels/cpu/recurrent.py): per-token state rows and
# 16-bit state storage, which the backend does not reach yet.

def _operands(B, T, Hq, Hk, Hv, K, V, decay="gk", update="erase_write", seed=0):
    """Random kernel operands in the kernel's layout (q [B, T, Hq / G, G, K], G = max(1, Hq / Hv))."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    G = max(1, Hq // Hv)
    q = torch.randn(B, T, Hq // G, G, K, generator=gen) / K ** 0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    x = dict(q=q, k=k, v=torch.randn(B, T, Hv, V, generator=gen), g=None, gk=None)
    if decay in ("g", "g+gk"):
        x["g"] = -0.2 * rand(B, T, Hv)
    if decay in ("gk", "g+gk"):
        x["gk"] = -0.5 * rand(B, T, Hv, K)
    if update == "beta":
        x["b"] = x["w"] = rand(B, T, Hv)
    else:
        x["b"], x["w"] = rand(B, T, Hv, K), rand(B, T, Hv, V)
    return x


def _call(x, S0, S, spans, token_rows=None, o=None, stream_state=False, threads=2):
    """cpu_recurrent.Recurrence on operands x; returns o (a fresh torch.empty unless given)."""
    from deltarule.kernels.cpu import layout as cpu_layout
    from deltarule.kernels.cpu import recurrent as cpu_recurrent

    B, T, Hv, V = x["v"].shape
    if o is None:
        o = torch.empty(B, T, Hv, x["q"].shape[3], V)
    spans = torch.tensor(spans, dtype=torch.int64).view(-1, 5)
    if token_rows is not None:
        token_rows = torch.tensor(token_rows, dtype=torch.int64)
    cpu_recurrent.Recurrence(x["q"], x["k"], x["v"], x["g"], x["gk"], x["b"], x["w"], None, None, S0, S, o, spans,
                             token_rows, None, scale=x["q"].shape[-1] ** -0.5, l2norm_eps=None,
                             stream_state=stream_state).run_packed(threads)
    return o


def _slab(rows, Hv, K, V, dtype=torch.float32, seed=1):
    """A slab of random states whose rows are not contiguous (a gap of 16 values after each row)."""
    wide = torch.randn(rows, Hv, K, V + 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return wide, wide[..., :V]


SPEC = [
    pytest.param(dict(Hq=8, Hk=4, Hv=4, K=100, V=72, decay="gk", update="erase_write"), id="gqa-kda-erase-write-K100-V72"),
    pytest.param(dict(Hq=2, Hk=2, Hv=4, K=99, V=128, decay="g+gk", update="erase_write"), id="gva-gdn2-K99-V128"),
    pytest.param(dict(Hq=8, Hk=4, Hv=4, K=64, V=128, decay="g", update="beta"), id="gqa-gdn-K64-V128"),
]


@pytest.mark.parametrize("shape", SPEC)
def test_token_rows_equal_chained_single_token_calls(nan_poison, shape):
    """Speculative verify: each sequence's tokens store their states into token rows (with -1
    gaps, columns past a sequence's end ignored, the read row one of its own later token rows,
    one sequence also with a final row). Each stored state, and every output, equals L chained
    one-token calls; rows nobody addresses stay bit-identical."""
    Hv, K, V = shape["Hv"], shape["K"], shape["V"]
    T = 5
    x = _operands(3, T, **shape)
    wide, slab = _slab(20, Hv, K, V)
    before = wide.clone()
    # (row, start, end, read row, final row), token rows per column; 19 is never addressed
    spans = [(0, 0, 5, 2, -1), (1, 1, 4, 7, 12), (2, 3, 4, 13, -1)]
    rows = [[0, 1, 2, 3, 4, 19], [6, -1, 7, 19, 19, 19], [13, 19, 19, 19, 19, 19]]
    o = _call(x, slab, slab, spans, rows)

    written = {r for n, (_, s, e, _, f) in enumerate(spans) for r in rows[n][:e - s] + [f] if r >= 0}
    for row in range(20):
        if row not in written:
            assert torch.equal(wide[row], before[row]), f"row {row} was not addressed"
    assert torch.equal(wide[..., V:], before[..., V:]), "the gaps between rows"
    for n, (row, start, end, read, final) in enumerate(spans):
        chain = before[..., :V][[read]].clone()              # the chain's state, row 0, in place
        o_chain = torch.empty_like(o)
        for t in range(start, end):
            _call(x, chain, chain, [(row, t, t + 1, 0, 0)], o=o_chain)
            r = rows[n][t - start]
            if r >= 0:
                assert rel(slab[r], chain[0]) < 1e-6, (n, t)
        if final >= 0:
            assert rel(slab[final], chain[0]) < 1e-6, n
        assert rel(o[row, start:end], o_chain[row, start:end]) < 1e-6, n
        assert torch.isfinite(o[row, start:end]).all()


@pytest.mark.parametrize("V", [72, 128])
def test_single_token_with_a_token_row_in_place_and_elsewhere(V):
    """One token (the decode path where V is a multiple of the tile): the token row is the read
    row (in place), another row, or both it and a final row; every read precedes its write."""
    Hv, K = 4, 100
    x = _operands(3, 1, 4, 4, Hv, K, V, decay="g", update="beta", seed=3)
    wide, slab = _slab(8, Hv, K, V)
    before = wide.clone()
    _call(x, slab, slab, [(0, 0, 1, 1, -1), (1, 0, 1, 2, -1), (2, 0, 1, 5, 6)], [[1], [3], [4]])
    fresh = torch.empty(3, Hv, K, V)
    _call(x, before[..., :V], fresh, [(0, 0, 1, 1, 0), (1, 0, 1, 2, 1), (2, 0, 1, 5, 2)])
    assert torch.equal(slab[1], fresh[0]) and torch.equal(slab[3], fresh[1])
    assert torch.equal(slab[4], fresh[2]) and torch.equal(slab[6], fresh[2])
    for row in (0, 2, 5, 7):
        assert torch.equal(wide[row], before[row]), row


HALF = [torch.bfloat16, torch.float16]


def _bits(x):
    return x.view(torch.int16) if x.dtype != torch.float32 else x.view(torch.int32)


def assert_rounded_like_torch(got, s32):
    """got (16-bit) equals torch's rounding of s32 bit for bit, NaN where s32 is NaN."""
    want = s32.to(got.dtype)
    nan = torch.isnan(s32)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,V", [(1, 128), (1, 72), (5, 128)], ids=["decode", "decode-V72", "tokens"])
def test_16_bit_states_are_widened_and_rounded_like_torch(nan_poison, dtype, T, V):
    """A 16-bit S0 gives what a float32 call on S0 widened gives (outputs and float32 states bit
    for bit); 16-bit stores (final and token rows, in place or fresh) are torch's rounding of
    the float32 result; a NaN in a state spreads the same way and stays NaN."""
    Hv, K = 4, 100
    x = _operands(2, T, 8, 4, Hv, K, V, seed=4)
    wide, slab = _slab(6, Hv, K, V, dtype)
    slab[3, 1, 7, 5] = float("nan")                          # row 3 is read: column 5 of head 1 turns NaN
    before = wide.clone()
    spans = [(0, 0, T, 3, 3), (1, 0, T, 1, -1)]               # in place; a fresh token row
    rows = [[-1] * T, [-1] * (T - 1) + [4]]
    wide32 = before.float()
    o16 = _call(x, slab, slab, spans, rows)
    o32 = _call(x, wide32[..., :V], wide32[..., :V], spans, rows)
    assert torch.equal(_bits(o16), _bits(o32))               # NaN outputs in column 5 of head 1 too
    nan = torch.zeros_like(o32, dtype=torch.bool)
    nan[0, :, 1, :, 5] = True                                # every other output was written
    assert torch.equal(torch.isnan(o32), nan)
    for row in (3, 4):
        assert_rounded_like_torch(slab[row], wide32[row, ..., :V])
    for row in (0, 1, 2, 5):
        assert torch.equal(_bits(wide[row]), _bits(before[row])), row
    fresh = torch.empty(2, Hv, K, V)                         # a 16-bit S0, a float32 S
    _call(x, before[..., :V], fresh, [(0, 0, T, 3, 0), (1, 0, T, 1, -1)], [[-1] * T, [-1] * (T - 1) + [1]])
    assert torch.equal(_bits(fresh), _bits(wide32[[3, 4], ..., :V]))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,V", [(1, 128), (2, 72)], ids=["decode", "tiles"])
def test_16_bit_stores_round_to_nearest_even_at_the_boundaries(dtype, T, V):
    """Identity steps (k = 0, no decay) store S0 itself: float32 values on and next to the
    16-bit rounding boundary (ties to even and odd, one ulp either side), that overflow to
    infinity, 16-bit subnormals and the smallest normals round exactly as torch rounds them.
    Two NaNs whose float32 bits would round to a number (all mantissa bits set; each spreads
    to its column through S^T (b k)) stay NaN."""
    Hv, K = 2, 64
    x = _operands(1, T, 2, 2, Hv, K, V, decay="g", update="beta", seed=5)
    x["k"].zero_()
    x["g"].zero_()
    gen = torch.Generator().manual_seed(6)
    low = 16 if dtype == torch.bfloat16 else 13             # float32 mantissa bits below the 16-bit type's
    big, small = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    bits = torch.randn(Hv * K * V, generator=gen).to(dtype).float().view(torch.int32)
    tie = 1 << (low - 1)
    offsets = torch.tensor([0, tie, tie - 1, tie + 1, 2 * tie - 1, 1], dtype=torch.int32)
    bits = (bits & ~((1 << low) - 1)) | offsets[torch.arange(bits.numel()) % len(offsets)]
    values = bits.view(torch.float32).clone()
    specials = torch.tensor([big, -big, big * (1 + 2.0 ** -8), torch.finfo(torch.float32).max,
                             small, small / 2, small / 3, small * 0.75, 1e-30, -small / 5, 3.0 ** -20, 65519.0])
    values[:len(specials)] = specials
    S0 = values.view(1, Hv, K, V)
    S0.view(torch.int32)[0, 0, 5, 20] = 0x7fffffff
    S0.view(torch.int32)[0, 1, 9, 30] = -1                   # 0xffffffff
    S32 = torch.empty(1, Hv, K, V)
    S16 = torch.empty(1, Hv, K, V, dtype=dtype)
    for S in (S32, S16):
        _call(x, S0, S, [(0, 0, T, 0, 0)])
    nan = torch.zeros_like(S0, dtype=torch.bool)
    nan[0, 0, :, 20] = nan[0, 1, :, 30] = True
    assert torch.equal(torch.isnan(S32), nan) and torch.equal(_bits(S32)[~nan], _bits(S0)[~nan])
    assert torch.isinf(S16.float()).any()                    # the boundaries were reached
    assert_rounded_like_torch(S16, S32)


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_empty_spans_store_their_initial_state(dtype):
    """A sequence without tokens but with a final row stores its state unchanged (the read row,
    rounded to S's dtype, or zeros without one); padding (no final row) touches nothing."""
    Hv, K, V = 2, 64, 128
    x = _operands(3, 2, 2, 2, Hv, K, V, decay="g", update="beta", seed=7)
    S0 = torch.randn(2, Hv, K, V)
    S = torch.full((4, Hv, K, V), 7.0, dtype=dtype)
    o = torch.zeros(3, 2, Hv, 1, V)
    _call(x, S0, S, [(0, 1, 1, 1, 0), (1, 0, 0, -1, 2), (2, 0, 0, -1, -1)], o=o)
    assert_rounded_like_torch(S[0], S0[1])
    assert torch.count_nonzero(S[2]) == 0
    assert torch.equal(S[[1, 3]], torch.full((2, Hv, K, V), 7.0, dtype=dtype))
    assert torch.count_nonzero(o) == 0

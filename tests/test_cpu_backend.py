"""The cpu backend's native kernel beyond the test.json comparison: it is
built wherever a C compiler exists, its threads and its huge-page outputs do
not change a bit, and it writes a strided slab where it lies."""

import shutil

import pytest
import torch

import deltarule
from deltarule import cases
from deltarule.backends import cpu_backend
from deltarule.check import expected

from conftest import rel

pytestmark = pytest.mark.skipif(not cpu_backend.available() and shutil.which("cc") is None,
                                reason="no C compiler here: the cpu backend's kernel could not be built")

CASE = {"name": "cpu", "seed": 5, "B": 3, "T": 37, "Hq": 8, "Hk": 4, "Hv": 4, "K": 100, "V": 72,
        "decay": "gk", "update": "erase_write", "initial_state": True}


def test_kernel_is_built_where_a_compiler_exists():
    assert cpu_backend.available(), "pip install did not build deltarule/kernels/csrc/recurrent.c"


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_threads_do_not_change_a_bit(monkeypatch, layout):
    args = cases.make_inputs(dict(CASE, state_layout=layout))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    o1, s1 = deltarule.linear_attention(**args, backend="cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", 1)     # 3 threads on this small call
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
    o, state = deltarule.linear_attention(**args, backend="cpu")
    want_o, want_s = expected(args)
    assert rel(o, want_o) < 5e-5 and rel(state, want_s) < 5e-5


DECODE = dict(CASE, T=1, V=128, initial_state=True)      # V a multiple of 64: the direct decode path


@pytest.mark.parametrize("over", [
    dict(decay="g", update="beta"),
    dict(decay="g+gk", update="erase_write"),
    dict(decay="gk", update="beta", Hq=4, Hk=4, Hv=4),
    dict(decay="gk", update="beta", Hq=2, Hk=2, Hv=4),
    dict(decay="g", update="beta", qk_l2norm=True),
], ids=["gdn-gqa", "gdn2-gqa", "kda", "kda-gva", "gdn-l2norm"])
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


def test_concurrent_calls_and_a_forked_child(monkeypatch):
    """The kernel keeps its helper threads between calls: calls from several Python
    threads at once (one uses the helpers, the others run alone) and a child forked
    after the helpers exist (it starts with none) still compute the right thing."""
    import concurrent.futures
    import os
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
            os.write(write_end, b"ok" if ok else b"wrong")
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

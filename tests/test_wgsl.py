"""The wgsl backend's shaders against the float64 reference, on any WebGPU adapter.

Without a GPU, wgpu finds Mesa's lavapipe (a CPU Vulkan driver: apt-get install
mesa-vulkan-drivers libvulkan1); where no adapter exists the module is skipped
with the reason. Shapes stay small: lavapipe runs every invocation on the CPU.
"""

import dataclasses
import importlib.util
import doctest
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_slab_updated_in_place, case_id, err, state_dtype, state_tol

from deltarule.kernels.wgsl import _device

_REASON = _device.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"no WebGPU device for the wgsl backend: {_REASON}", allow_module_level=True)

import torch  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.backends import wgsl_backend  # noqa: E402
from deltarule.tools.check import expected  # noqa: E402
from deltarule.kernels import wgsl  # noqa: E402
from deltarule import WgslStateSlab  # noqa: E402
from deltarule.kernels.wgsl import recurrent  # noqa: E402

pytestmark = pytest.mark.wgsl

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
ROOT = Path(__file__).resolve().parents[1]


def small(**over) -> dict:
    """A test.json-style case dict: tiny sizes, overridable."""
    case = dict(name="small", seed=200, B=2, T=5, Hq=2, Hk=2, Hv=2, K=16, V=24, rule="gated_delta")
    case.update(over)
    return case


def check(args: dict, tol: float):
    """Run the wgsl backend on `args`; compare o and the state with the reference."""
    ref_o, ref_state = expected(args)          # before the call: a slab is updated in place
    o, state = deltarule.linear_attention(**args, backend="wgsl")
    assert o.dtype == args["v"].dtype and state.dtype == state_dtype(args)
    e_o, e_s = err(o, ref_o), err(state, ref_state)
    assert e_o <= tol and e_s <= state_tol(args, tol), f"err(o)={e_o:.2e} err(S)={e_s:.2e} tol={tol:.0e}"
    return o, state


@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, d, id=f"{c['name']}-{d}") for c in cases.test_cases() for d in c["dtypes"]
])
def test_test_json_case(case, dtype):
    check(cases.make_inputs(case, dtype), float(case["tol"][dtype]))


DENSE = [
    small(B=1, T=1, K=100, V=60, decay="gk", update="erase_write", initial_state=True),
    small(B=2, T=63, K=100, V=72, decay="gk", initial_state=True),
    small(B=1, T=65, Hq=4, Hk=4, Hv=8, K=100, V=48, decay="gk"),          # KDA, GVA 2x
    small(B=2, T=17, Hq=2, Hk=2, Hv=8, K=100, V=40, initial_state=True),   # GVA 4x
    small(B=2, T=9, Hq=8, Hk=2, Hv=2, K=32, V=33, decay="g+gk"),          # GQA 4x
    small(B=1, T=65, K=100, V=20, decay="gk", decay_range=[-8.0, -4.0]),  # strong decay
    small(B=2, T=11, K=40, V=24, qk_l2norm=True, raw_gate=True, beta_sigmoid=True, initial_state=True),
    small(B=1, T=12, K=24, V=40, decay="gk", raw_gate=True, update="erase_write", beta_sigmoid=True),
    small(B=2, T=7, K=24, V=40, initial_state=True, state_layout="vk", decay="gk"),
]


@pytest.mark.parametrize("case", DENSE, ids=case_id)
def test_dense_writes_every_output(nan_output, case):
    """Odd T, K = 100, GVA, GQA, strong decay, in-shader gates, vk: every output element written."""
    check(cases.make_inputs(case), TOL["float32"])


@pytest.mark.parametrize("rule,decay,update", [
    ("linear", "none", "none"), ("gated", "g", "none"), ("gated", "gk", "none"),
    ("delta", "none", "beta"), ("delta", "none", "erase_write"),
    ("gated_delta", "gk", "beta"), ("gated_delta", "g+gk", "erase_write"),
])
def test_rules_and_gates(rule, decay, update):
    check(cases.make_inputs(small(rule=rule, decay=decay, update=update, initial_state=True)), TOL["float32"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [
    small(B=2, T=9, Hq=2, Hk=2, Hv=8, K=100, V=24, decay="gk", qk_l2norm=True),
    small(B=2, T=5, Hq=6, Hk=3, Hv=3, K=20, V=9, update="erase_write", raw_gate=True),
], ids=case_id)
def test_half_inputs(case, dtype):
    """16-bit inputs are packed pairs on the device (odd element counts included)."""
    check(cases.make_inputs(case, dtype), TOL[dtype])


@pytest.mark.parametrize("case", [
    small(B=1, T=30, cu_seqlens=[0, 0, 7, 7, 30], initial_state=True, decay="gk"),   # empty requests
    small(B=1, T=20, cu_seqlens=[-3, 12, 5, 40], initial_state=True, state_layout="vk"),  # clamped, overlap
    small(B=3, T=9, seq_lens=[9, 0, 4], initial_state=True, Hq=4, Hk=2, Hv=2),
    small(B=1, T=25, cu_seqlens=[0, 10, 10, 25], initial_state=True, state_indices=[2, 0, -1], num_slots=4),
], ids=case_id)
def test_varlen(case):
    check(cases.make_inputs(case), TOL["float32"])


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_torch_slab_in_place_untouched_rows_bit_identical(layout):
    case = small(B=3, T=4, K=20, initial_state=True, state_indices=[3, -1, 0], num_slots=5, state_layout=layout)
    args = cases.make_inputs(case)
    slab = args["initial_state"]
    before = slab.clone()
    o, state = check(args, TOL["float32"])
    assert_slab_updated_in_place(state, slab, before, o, case["state_indices"])


def test_initial_state_untouched():
    args = cases.make_inputs(small(initial_state=True))
    before = args["initial_state"].clone()
    _, state = check(args, TOL["float32"])
    assert torch.equal(args["initial_state"], before) and state.data_ptr() != before.data_ptr()


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_device_slab_decode_equals_one_prefill(layout):
    """Five decode steps on a WgslStateSlab (the state never leaves the device) = one prefill call."""
    case = small(B=2, T=5, K=100, V=20, decay="gk", update="erase_write", initial_state=True,
                 state_indices=[3, 1], num_slots=5, state_layout=layout)
    args = cases.make_inputs(case)
    host_slab = args["initial_state"]
    slab = WgslStateSlab.from_tensor(host_slab, layout=layout)
    ref_o, ref_slab = expected(args)
    outputs = []
    for t in range(case["T"]):
        step = {n: (x[:, t:t + 1] if n in ("q", "k", "v", "gk", "erase", "write") else x) for n, x in args.items()}
        step["initial_state"] = slab
        o, state = deltarule.linear_attention(**step)           # "auto" routes a device slab to wgsl
        assert state is slab
        outputs.append(o)
    o = torch.cat(outputs, dim=1)
    rows = slab.download()
    assert err(o, ref_o) <= TOL["float32"] and err(rows, ref_slab) <= TOL["float32"]
    for row in (0, 2, 4):
        assert torch.equal(rows[row], host_slab[row])


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_device_slab_speculative_step(layout):
    """A speculative plan on a WgslStateSlab: per-token rows stored on the device, the accepted
    rows read, a padding sequence and rows not addressed untouched, as the reference."""
    case = small(B=3, T=3, K=20, V=12, decay="gk", initial_state=True, state_layout=layout,
                 state_indices=[[6, 0, 2], [1, -1, 3], [4, 5, -1]], num_accepted_tokens=[3, 1, 3], num_slots=8)
    args = cases.make_inputs(case)
    host_slab = args["initial_state"]
    ref_o, ref_slab = expected(args)
    slab = WgslStateSlab.from_tensor(host_slab, layout=layout)
    o, state = deltarule.linear_attention(**dict(args, initial_state=slab))
    assert state is slab
    rows = slab.download()
    assert err(o, ref_o) <= TOL["float32"] and err(rows, ref_slab) <= TOL["float32"]
    assert torch.count_nonzero(o[2]) == 0                           # reads row -1: padding
    for row in (4, 5, 7):
        assert torch.equal(rows[row], host_slab[row])


def test_device_slab_is_declined_elsewhere_and_checked():
    args = cases.make_inputs(small(initial_state=True, state_indices=[0, 1], num_slots=2))
    args["initial_state"] = WgslStateSlab.from_tensor(args["initial_state"])
    with pytest.raises(deltarule.Unsupported, match="lives on the 'wgsl' backend's device"):
        deltarule.linear_attention(**args, backend="torch")
    with pytest.raises(deltarule.ContractError, match="state_layout"):
        deltarule.linear_attention(**dict(args, state_layout="vk"))
    with pytest.raises(deltarule.ContractError, match="state_indices"):
        deltarule.linear_attention(**dict(args, state_indices=None))
    with pytest.raises(deltarule.ContractError, match="state_indices"):
        deltarule.linear_attention(**dict(args, state_indices=torch.tensor([0, 2], dtype=torch.int32)))


def test_long_sequences_run_in_segments(monkeypatch):
    """Sequences longer than SEGMENT continue across dispatches from the state in place."""
    monkeypatch.setattr(recurrent, "SEGMENT", 4)
    case = small(B=1, T=23, cu_seqlens=[0, 3, 3, 23], initial_state=True, decay="gk", update="erase_write")
    check(cases.make_inputs(case), TOL["float32"])


def test_declines_when_the_adapter_has_too_few_bindings(monkeypatch):
    real = _device.gpu()
    monkeypatch.setattr(_device, "gpu", lambda: dataclasses.replace(real, max_storage_buffers=8))
    args = cases.make_inputs(small(decay="g+gk", update="erase_write"))
    with pytest.raises(deltarule.Unsupported, match="needs 10 storage buffers"):
        deltarule.linear_attention(**args, backend="wgsl")
    assert wgsl_backend.supports(deltarule.validate(**cases.make_inputs(small()))) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_matches_deltarule_gate(dtype):
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(3, 7, 5, generator=gen) * 12).to(dtype)     # the softplus tails included
    b = (torch.randn(3, 7, 5, generator=gen) * 12).to(dtype)
    dt_bias, scale = torch.randn(5, generator=gen), -torch.rand(5, generator=gen)
    decay, beta = wgsl.fused_gate(a, dt_bias, scale, b)
    ref_decay, ref_beta = deltarule.gate(a, dt_bias, scale, b=b)
    assert decay.dtype == dtype and beta.shape == b.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert err(decay, ref_decay.double().numpy()) <= tol and err(beta, ref_beta.double().numpy()) <= tol
    decay_only, none = wgsl.fused_gate(a[:0], dt_bias, scale)
    assert decay_only.shape == (0, 7, 5) and none is None


def test_specialization_is_cached_per_key():
    args = cases.make_inputs(small())
    deltarule.linear_attention(**args, backend="wgsl")
    hits = _device.pipeline.cache_info().hits
    deltarule.linear_attention(**args, backend="wgsl")
    assert _device.pipeline.cache_info().hits == hits + 1
    spec = dict(recurrent.specialization(deltarule.validate(**args)))
    assert spec["K"] == 16 and spec["layout"] == "kv" and spec["dt_qkv"] == "f32"


def test_card_only_specializations_compile():
    """The kernel cards (deltarule/cards) specialize the shared templates beyond what this backend
    asks for: the bounded sigmoid ("kda") raw gate in both shaders, the capture rows placed in
    the output buffer, narrow.wgsl.jinja's float32 copy and zero fill. Each compiles on this
    adapter; web/test/cards.test.js checks their values in Dawn and Chromium."""
    from deltarule.kernels.wgsl import chunked

    args = cases.make_inputs(small(decay="gk", raw_gate=True, qk_l2norm=True))
    args["capture"] = torch.zeros(args["q"].shape[0], 3 * (2 * 16 + 2 * 16 + 2 * 24))
    p = deltarule.validate(**args)
    rec = dict(recurrent.specialization(p), gate_fn="sigmoid")
    assert rec["capture"] == 3 and rec["raw_gate"] == "gk"
    intra, _ = chunked.specialization(p)
    for template, spec in (("recurrent.wgsl.jinja", rec), ("recurrent.wgsl.jinja", dict(rec, capture_in_out=True)),
                           ("recurrent.wgsl.jinja", dict(rec, has_gk=False, has_g=True, dt_g="f32", raw_gate="g")),
                           ("chunked_intra.wgsl.jinja", dict(intra, gate_fn="sigmoid")),
                           ("narrow.wgsl.jinja", {"dtype": "f32"}), ("narrow.wgsl.jinja", {"dtype": "zero"})):
        code = _device.render(template, tuple(sorted(spec.items())))
        assert ("sigmoid(decay_rate" in code) == (spec.get("gate_fn") == "sigmoid"), template
        _device.pipeline(template, tuple(sorted(spec.items())))


def test_slab_docstring_example_runs():
    from deltarule.backends import wgsl_slab as slab
    result = doctest.testmod(slab)
    assert result.attempted > 0 and result.failed == 0


def test_packed_16bit_words_round_trip():
    x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    words = struct.unpack("<2I", _device._padded(_device.tensor_bytes(x)))
    assert words[0] & 0xFFFF == x.view(torch.int16)[0].item() & 0xFFFF


def test_gpu_script_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wgsl_gpu.py"), "--dry-run",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for header in ("== environment ==", "== correctness ==", "== prefill ==", "== decode =="):
        assert header in proc.stdout
    assert "FAIL" not in proc.stdout and (tmp_path / "wgsl_gpu.md").exists()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_loads_after_a_wgsl_call():
    """lavapipe and Triton both carry LLVM: the backend loads Triton before its adapter,
    so a process that ran a wgsl call can still import triton (it crashed before)."""
    code = ("import torch, deltarule\n"
            "q = k = v = torch.ones(1, 2, 1, 4)\n"
            "deltarule.linear_attention(q, k, v, rule='linear', backend='wgsl')\n"
            "import triton\n"
            "print('alive')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "alive" in run.stdout, run.stderr[-2000:]

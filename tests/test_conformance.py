"""Every backend against the float64 reference on every test.json case."""

import pytest
import torch

import deltarule
from deltarule.tools.check import compare
from deltarule import cases

from deltarule.backends import cpu_backend

from conftest import CPU, case_params

BACKENDS = [CPU, "torch", "reference"]


def test_enough_cases():
    all_cases = cases.test_cases()
    assert len(all_cases) >= 40
    assert len({c["name"] for c in all_cases}) == len(all_cases)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,dtype", case_params())
def test_backend_matches_reference(backend, case, dtype):
    r = compare(case, dtype, backend)
    assert r.passed, f"{backend} {case['name']} {dtype}: err(o)={r.err_o:.2e} err(S)={r.err_state:.2e} tol={r.tol:.0e}"


@pytest.mark.parametrize("backend", [CPU, "torch"])
@pytest.mark.parametrize("case,dtype", case_params(dtypes=["float32"]))
def test_backend_writes_every_output_element(nan_poison, backend, case, dtype):
    """With uninitialised memory poisoned to NaN, outputs and states stay finite and correct."""
    r = compare(case, dtype, backend)
    assert r.passed, f"err(o)={r.err_o:.2e} err(S)={r.err_state:.2e}"


def test_auto_order_on_cpu():
    case = cases.test_cases()[0]
    assert compare(case, "float32", "auto").passed
    names = [b["name"] for b in deltarule.backend_info()]
    assert names == ["cpu", "triton", "torch", "reference", "wgsl"]


def test_cpu_backend_declines_other_devices():
    if not cpu_backend.available():
        pytest.skip("the cpu backend's native kernel was not built")
    args = cases.make_inputs(cases.test_cases()[0], device="meta")
    with pytest.raises(deltarule.Unsupported, match="CPU tensors only"):
        deltarule.linear_attention(**args, backend="cpu")


def test_unknown_dtype_output_follows_v():
    args = cases.make_inputs(cases.test_cases()[0], "bfloat16")
    o, state = deltarule.linear_attention(**args)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_nan_poison_is_effective(nan_poison):
    assert torch.isnan(torch.empty(16)).all()


def test_manifest_names_every_api_argument():
    import inspect
    manifest = cases.manifest()
    declared = {i["name"] for i in manifest["inputs"]} | {a["name"] for a in manifest["attributes"]}
    params = set(inspect.signature(deltarule.linear_attention).parameters)
    assert declared == params
